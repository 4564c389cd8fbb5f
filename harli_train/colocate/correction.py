"""OnlineCorrection: the measured/predicted factors a ``LatencyPredictor`` applies to its predictions.

A prediction is corrected online by EWMAs of measured/predicted latency per (solo, co-run; decode, mixed):
one per share and one GPU-wide, and the larger of the two applies. Both catch a slower step at once
(``alpha_up``) and decay slowly (``alpha``). The GPU-wide factor carries a miss to the share decode grows to
next, and to a share not yet measured; the per-share one keeps a share that is slower on its own from being
chosen again as soon as the GPU-wide one decays. A share's own excess over the GPU-wide factor relaxes
toward it on every step measured elsewhere (``idle_alpha``: a share is measured only while it is in use);
likewise the co-run family's GPU-wide factor relaxes toward the solo one while only solo steps run (the
trainer paused), and the other way round.

A share that is slower than the model on its own, visit after visit, is not a spike: a visit (the decode
steps of one family on one share in a row, judged on its first ``VISIT_STEPS``) whose median ratio exceeds
the GPU-wide factor at its start by ``CONFIRM`` confirms the share's excess. Once ``n >= 2`` visits in a
row have confirmed it (one may be a GPU-wide episode), the share's excess relaxes at ``idle_alpha / n`` and
its misses are its own (they do not raise the GPU-wide factor, which would put the shares decode returns
to over budget too); a visit as modelled ends the confirmation.

The runs behind each rule are in docs/design.md: the online correction's rows of "Measured facts behind
the defaults", and the rows on the first step on a share decode just shrank to and on a share slower than
the model visit after visit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

RATIO_CLAMP = (0.5, 2.0)  # a single stall or lucky step must not swing the correction far
# A visit's median ratio this far over the GPU-wide factor at its start confirms its share's excess.
CONFIRM = 0.05
VISIT_STEPS = 16  # a visit is judged on its first this many steps (or fewer, when it ends before)


@dataclass(slots=True)
class Visit:
    """Decode steps of one family on one share in a row: their ratios, up to when the visit is judged."""

    sms: int
    family: int
    glob: float  # the family's GPU-wide factor when the visit began
    ratios: list[float] = field(default_factory=list)
    judged: bool = False


class OnlineCorrection:
    """The online correction of ``LatencyPredictor`` (a mixin over its fields: ``alpha``, ``alpha_up``,
    ``idle_alpha``, ``share_confirm``, ``mixed``, ``_glob``, ``_corr``, ``_mixed_q``, ``_visit`` and
    ``_confirmed``)."""

    __slots__ = ()
    alpha: float
    alpha_up: float
    idle_alpha: float
    share_confirm: float  # ``CONFIRM``; infinite: no visit confirms a share's excess (the rule off)
    mixed: Any
    _glob: list[float]
    _corr: dict[int, list[float]]
    _mixed_q: tuple[Any, ...]
    _visit: Visit | None  # the decode visit under way
    _confirmed: dict[tuple[int, int], int]  # (sms, family) -> visits in a row that confirmed its excess

    def observe(
        self,
        infer_sms: int,
        corun: bool,
        measured_s: float,
        raw_predicted_s: float,
        mixed: bool = False,
        beside_backward: bool = False,
        own_share: bool = False,
    ) -> float:
        """Fold a measured step latency into the share's correction; returns the new correction factor.

        ``raw_predicted_s`` is the uncorrected prediction for that step (``predict(..., raw=True)``, or
        ``predict_mixed`` for a mixed step). ``beside_backward``: a co-run mixed step planned with a trainer
        backward on the GPU; its ratio also feeds that case's own quantile (see ``correction``).
        ``own_share``: the step's error belongs to its share, not to the GPU (the controller's first step on a
        share it just shrank to); only that share's factor learns it, so the miss does not also put the shares
        decode left over budget.
        """
        family = int(corun) + 2 * mixed
        raw = raw_predicted_s
        if not (measured_s > 0 and raw > 0 and math.isfinite(measured_s)):
            return self.correction(infer_sms, corun, mixed, beside_backward)
        ratio = min(max(measured_s / raw, RATIO_CLAMP[0]), RATIO_CLAMP[1])
        own = self._corr.setdefault(infer_sms, [1.0] * 4)
        if not mixed:
            self._visit_step(infer_sms, family, ratio)
            own_share = own_share or self._confirmed.get((infer_sms, family), 0) >= 2
        # Asymmetric: under-predicting risks the objective on the very next steps, over-predicting only costs
        # the trainer some SMs until the decay brings the share back.
        for factors in (own,) if own_share else (own, self._glob):
            alpha = self.alpha_up if ratio > factors[family] else self.alpha
            factors[family] += alpha * (ratio - factors[family])
        if own_share:
            return self.correction(infer_sms, corun, mixed, beside_backward)
        self._relax_unused(infer_sms, family)
        if mixed:
            self._mixed_q[int(corun)].add(ratio)
            if corun and beside_backward:
                self._mixed_q[2].add(ratio)
        return self.correction(infer_sms, corun, mixed, beside_backward)

    def _visit_step(self, infer_sms: int, family: int, ratio: float) -> None:
        """Count a decode step's ratio in the visit of its share and family; a visit is judged (confirming its
        share's excess, or ending the confirmation) at its ``VISIT_STEPS``-th step, or when a step on another
        share or family ends it before."""
        visit = self._visit
        if visit is not None and (visit.sms, visit.family) == (infer_sms, family):
            if not visit.judged:
                visit.ratios.append(ratio)
                if len(visit.ratios) >= VISIT_STEPS:
                    self._judge(visit)
            return
        if visit is not None and not visit.judged:
            self._judge(visit)
        self._visit = Visit(infer_sms, family, self._glob[family], [ratio])

    def _judge(self, visit: Visit) -> None:
        ratios = sorted(visit.ratios)
        key = (visit.sms, visit.family)
        if ratios[len(ratios) // 2] > (1.0 + self.share_confirm) * visit.glob:
            self._confirmed[key] = self._confirmed.get(key, 0) + 1
        else:
            self._confirmed.pop(key, None)
        visit.judged = True

    def _relax_unused(self, infer_sms: int, family: int) -> None:
        """What this step did not measure relaxes, by ``idle_alpha``, toward what it did: the GPU-wide factor
        of the same kind of step with the trainer in the other state (solo <-> co-run) toward this one's, and
        every share's factor of that kind that was not measured toward its family's GPU-wide one. Only an
        excess relaxes: a co-run spike learnt just before the trainer paused must not stay in force while
        decode runs alone, or no share fits beside the trainer again."""
        a, other = self.idle_alpha, family ^ 1
        if self._glob[other] > self._glob[family]:
            self._glob[other] -= a * (self._glob[other] - self._glob[family])
        for fam in (family, other):
            glob = self._glob[fam]
            for sms, factors in self._corr.items():
                if factors[fam] > glob and (sms != infer_sms or fam != family):
                    factors[fam] -= a / max(self._confirmed.get((sms, fam), 0), 1) * (factors[fam] - glob)

    def correction(
        self, infer_sms: int, corun: bool, mixed: bool = False, beside_backward: bool = False
    ) -> float:
        """The factor ``predict`` (``predict_mixed``) applies on ``infer_sms``: the larger of the share's and
        the GPU-wide one; a mixed step's is at least its family's floor (``_mixed_floor``), and a co-run one
        ``beside_backward`` at least the quantile of the recent steps observed beside a backward, once there
        are enough (a backward's kernels slow a mixed step beside them more than a forward's)."""
        family = int(corun) + 2 * mixed
        corr = self._corr.get(infer_sms)
        factor = max(1.0 if corr is None else corr[family], self._glob[family])
        if not mixed:
            return factor
        factor = max(factor, self._mixed_floor(int(corun)))
        backward = self._mixed_q[2].value if corun and beside_backward else None
        return factor if backward is None else max(factor, backward)

    def _mixed_floor(self, kind: int) -> float:
        """The least correction of mixed steps (``kind`` 0: solo, 1: co-run): the quantile of the recent
        ratios once there are enough, before that the mixed fit's largest error on its profile samples."""
        recent = self._mixed_q[kind].value
        if recent is not None:
            return recent
        report = self.mixed.fit_report if self.mixed is not None else {}
        worst = report.get(f"fit_mixed_{'corun' if kind else 'solo'}_max_ape_pct", 0.0)
        return min(1.0 + worst / 100.0, RATIO_CLAMP[1])

    def reset_corrections(self) -> None:
        self._corr.clear()
        self._glob[:] = [1.0] * 4
        self._visit = None
        self._confirmed.clear()
        for recent in self._mixed_q:
            recent.clear()
