"""Two-stage linear model of a decode step's latency on an SM share, alone and beside the trainer.

Stage 1 (solo), for a step of ``b`` sequences reading ``kv`` bytes of KV cache on ``s`` SMs::

    t_solo = A[s] + C[s] * kv  +  g1 * m/s + g2 * m^2/s + g3 * m^3/s + g4 * b,   m = gemv_rows(b, s)

``A[s]`` is the weight read at the bandwidth share ``s`` can draw plus launch overhead (the weights are
fixed for a profiled model), ``C[s]`` is one over the bandwidth ``s`` draws for the KV read, the ``m/s``
terms are the projections' compute spread over ``s`` SMs (the GEMV-to-GEMM transition), ``g4 * b`` is
per-sequence work that does not scale with SMs. The projections compute ``m`` rows, not ``b``: the decode
GEMV pads a step's batch bucket to its tile's rows (``gemv_rows``: 1 at batch 1 on most of the GPU, else 16,
32, 64), so a step of 33 sequences costs what one of 64 does there. The bandwidth is fitted per share
because it saturates sharply (about half the GPU already draws full HBM bandwidth): ``a + b/s + c/s^2``
missed the H200 figures in docs/design.md by up to 12 %. Shares the profile covers too thinly are
interpolated in ``1/s``.

Stage 2 (co-run) multiplies by the slowdown of a trainer on the complementary share::

    t_corun = t_solo * (1 + intensity * (D[s] + e1 * b + e2 * kv))

``D[s]`` is the bandwidth and L2 contention at that split; ``intensity`` scales it for a lighter or
heavier trainer than the profiled one. Both stages are linear least squares (numpy), weighted to minimise
relative error. At run time every share's terms are folded into one tuple of floats, so a prediction is
a handful of Python multiplications (about 1 us), corrected online (``correction.OnlineCorrection``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harli_train.colocate.correction import CONFIRM, OnlineCorrection, Visit
from harli_train.colocate.lora_cost import LoRACost, MixedLoRACost
from harli_train.colocate.mixed_model import MixedStepModel
from harli_train.colocate.recent_quantile import RecentQuantile
from harli_train.colocate.regression import weighted_lstsq
from harli_train.engine.decode_linear import FMA_MIN_SMS

N_GLOBAL = 4  # m/s, m^2/s, m^3/s, b
BATCH_TERMS = "gemv_rows"  # what a saved predictor's solo_global multiplies (`to_dict`, `from_dict`)


def gemv_rows(batch: int, sms: float | None = None, fma_min_sms: int = FMA_MIN_SMS) -> int:
    """The rows a decode step of ``batch`` sequences computes in its projections on ``sms`` SMs (None: the
    whole GPU): one row streamed with FMAs (batch 1 on at least ``fma_min_sms``), else the tensor-core tile's
    rows (``decode_linear_config``'s ``block_m``: the power of two at or above the batch, at least 16; the
    engine's default graph buckets never cross a power of two)."""
    if batch <= 1 and (sms is None or sms >= fma_min_sms):
        return 1
    return max(16, 1 << (int(batch) - 1).bit_length())


def fit_options(meta: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``LatencyPredictor.fit`` a profile's ``meta`` pins down: the token buckets of
    its mixed graphs, and the SMs from which its batch-1 steps were timed on the FMA GEMV (a profile made
    before batch 1 took the tensor-core tiles on a partition's few SMs lacks it: FMAs on every share, 0)."""
    return {
        "mixed_buckets": tuple(meta.get("mixed_buckets", ())),
        "fma_min_sms": int(meta.get("fma_min_sms", 0)),
    }


@dataclass(slots=True)
class LatencyPredictor(OnlineCorrection):
    """Fitted two-stage model; ``predict`` is pure Python over precomputed per-share tuples."""

    total_sms: int
    kv_bytes_per_token: float
    shares: list[int]  # profiled inference SM counts, ascending
    share_params: dict[int, list[float]]  # sms -> [A, C, D]
    solo_global: list[float]  # g1..g4
    slow_global: list[float]  # e1, e2
    batch_max: int
    alpha: float = 0.1  # EWMA weight of the newest measured/predicted ratio when it is below the correction
    alpha_up: float = 0.5  # ... and when it is above: running slower than predicted is caught at once
    idle_alpha: float = 0.02  # per step: how much of an unmeasured factor's excess relaxes to a measured one
    share_confirm: float = CONFIRM  # a share's visits confirm its excess over this (``OnlineCorrection``)
    intensity: float = 1.0
    fit_report: dict[str, Any] = field(default_factory=dict)
    mixed: MixedStepModel | None = None  # mixed steps (decode rows + prefill chunks); None: not profiled
    lora: LoRACost | None = None  # what adapters add to a decode step; None: not profiled (no adapter slots)
    mixed_lora: MixedLoRACost | None = None  # what one adapter adds to a mixed step; None: not profiled
    fma_min_sms: int = FMA_MIN_SMS  # gemv_rows' FMA threshold the samples were timed with (``fit_options``)
    _rows: dict[int, tuple[float, ...]] = field(default_factory=dict, repr=False)
    # A mixed step's chunk is sized to fill the budget, so the spread of its prediction error (wide beside
    # the trainer), not its mean, is what overruns the objective: the mixed families' correction is at least
    # this quantile of their last `mixed_window` measured / raw ratios (GPU-wide; from `mixed_min_samples`;
    # before that, 1 + the mixed fit's largest relative error on the profile).
    mixed_quantile: float = 0.95
    mixed_window: int = 64
    mixed_min_samples: int = 8
    # Correction factors by family: decode solo, decode co-run, mixed solo, mixed co-run.
    _glob: list[float] = field(default_factory=lambda: [1.0] * 4, repr=False)  # GPU-wide
    _corr: dict[int, list[float]] = field(default_factory=dict, repr=False)  # sms -> per family
    # solo, co-run, and co-run beside a trainer backward (the backward-aware floor: ``beside_backward``)
    _mixed_q: tuple[RecentQuantile, ...] = field(default=(), repr=False)
    _visit: Visit | None = field(default=None, repr=False)  # OnlineCorrection's visits of shares
    _confirmed: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.shares:
            raise ValueError("a predictor needs at least one profiled SM share")
        self.shares = sorted(self.shares)
        self._rows = {s: self._fold(s) for s in self.shares}
        q = (self.mixed_quantile, self.mixed_window, self.mixed_min_samples)
        self._mixed_q = (RecentQuantile(*q), RecentQuantile(*q), RecentQuantile(*q))

    # --- fitting ---------------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        samples: Sequence[dict],
        total_sms: int,
        kv_bytes_per_token: float,
        alpha: float = 0.1,
        mixed_buckets: Sequence[int] = (),
        fma_min_sms: int = FMA_MIN_SMS,
    ) -> LatencyPredictor:
        """Fit both stages to decode samples ``{batch, kv_tokens, infer_sms, corun, latency_s}``, and the
        mixed model to mixed samples (those with ``prefill_tokens``) when the profile has them, on the token
        buckets the engine's mixed graphs pad a step to (``mixed_buckets``); batch-1 samples count the GEMV
        rows of the kernel they were timed on (``fma_min_sms``).
        ``fit_options`` reads both from a profile's meta."""
        mixed = [r for r in samples if "prefill_tokens" in r and not r.get("lora_slots")]
        lora = LoRACost.fit(samples)
        mixed_lora = MixedLoRACost.fit(samples, mixed_buckets)
        samples = [r for r in samples if "prefill_tokens" not in r and not r.get("lora_slots")]
        solo = [r for r in samples if not r["corun"]]
        corun = [r for r in samples if r["corun"]]
        # A share's A and C need at least two KV sizes; thinner shares are interpolated from neighbours.
        kv_sizes: dict[int, set] = {}
        for r in solo:
            kv_sizes.setdefault(int(r["infer_sms"]), set()).add(r["kv_tokens"])
        shares = sorted(s for s, kvs in kv_sizes.items() if len(kvs) >= 2)
        skipped = sorted(set(kv_sizes) - set(shares))
        if not shares:
            raise ValueError("no SM share has solo samples at two KV sizes to fit stage 1")
        solo = [r for r in solo if int(r["infer_sms"]) in shares]
        col = {s: i for i, s in enumerate(shares)}
        k = len(shares)

        # Only the batch terms the grid can pin down: a cubic needs 4 row counts, b vs m/s two shares.
        n_batches = len({gemv_rows(r["batch"], r["infer_sms"], fma_min_sms) for r in solo})
        used = [j < min(3, n_batches - 1) for j in range(3)] + [n_batches > 1 and k > 1]
        X = np.zeros((len(solo), 2 * k + N_GLOBAL))
        y = np.array([float(r["latency_s"]) for r in solo])
        for i, r in enumerate(solo):
            b, s = float(r["batch"]), float(r["infer_sms"])
            m = float(gemv_rows(r["batch"], s, fma_min_sms))
            X[i, col[int(s)]] = 1.0
            X[i, k + col[int(s)]] = float(r["kv_tokens"]) * kv_bytes_per_token
            X[i, 2 * k :] = (m / s, m * m / s, m**3 / s, b)
        X[:, 2 * k :] *= np.array(used, dtype=float)  # an all-zero column gets a zero coefficient
        coef = weighted_lstsq(X, y, 1.0 / y)
        params = {s: [float(coef[col[s]]), float(coef[k + col[s]]), 0.0] for s in shares}
        pred = cls(
            total_sms,
            kv_bytes_per_token,
            shares,
            params,
            [float(c) for c in coef[2 * k :]],
            [0.0, 0.0],
            max(int(r["batch"]) for r in solo),
            alpha=alpha,
            fma_min_sms=fma_min_sms,
        )
        if corun:
            pred._fit_stage2(solo, corun)
        if mixed:
            pred.mixed = MixedStepModel.fit(mixed, mixed_buckets)
        pred.lora, pred.mixed_lora = lora, mixed_lora
        pred.fit_report = {
            "skipped_shares": skipped,
            "n_solo": len(solo),
            "n_corun": len(corun),
            "n_mixed": len(mixed),
            **pred.evaluate(samples, prefix="fit_"),
            **(pred.mixed.fit_report if pred.mixed else {}),
        }
        return pred

    def _fit_stage2(self, solo: list[dict], corun: list[dict]) -> None:
        """Slowdown over the *measured* solo latency of the same point where the profile has it."""
        measured = {(r["batch"], r["kv_tokens"], r["infer_sms"]): float(r["latency_s"]) for r in solo}
        shares = sorted({int(r["infer_sms"]) for r in corun})
        col = {s: i for i, s in enumerate(shares)}
        k = len(shares)
        X = np.zeros((len(corun), k + 2))
        ratio = np.empty(len(corun))
        for i, r in enumerate(corun):
            key = (r["batch"], r["kv_tokens"], r["infer_sms"])
            ref = measured.get(key) or self.predict(
                r["batch"], r["kv_tokens"], r["infer_sms"], False, raw=True
            )
            ratio[i] = float(r["latency_s"]) / ref
            X[i, col[int(r["infer_sms"])]] = 1.0
            X[i, k:] = (float(r["batch"]), float(r["kv_tokens"]) * self.kv_bytes_per_token)
        coef = weighted_lstsq(X, ratio - 1.0, 1.0 / ratio)
        self.slow_global = [float(coef[k]), float(coef[k + 1])]
        fitted = {s: float(coef[col[s]]) for s in shares}
        for s in self.shares:  # solo-only shares (the full GPU) borrow the nearest co-run share's D
            nearest = min(shares, key=lambda c: abs(c - s))
            self.share_params[s][2] = fitted.get(s, fitted[nearest])
        self._rows = {s: self._fold(s) for s in self.shares}

    # --- prediction ------------------------------------------------------------------------------------

    def _params_at(self, sms: int) -> list[float]:
        """A, C, D at an SM count, interpolated in 1/s between profiled shares (conservative below them)."""
        if sms in self.share_params:
            return self.share_params[sms]
        shares = self.shares
        if sms < shares[0]:
            a, c, d = self.share_params[shares[0]]
            scale = shares[0] / sms  # fewer SMs than ever profiled: assume the reads slow down in proportion
            return [a * scale, c * scale, d]
        if sms > shares[-1]:
            return self.share_params[shares[-1]]
        hi = bisect.bisect_left(shares, sms)
        s_lo, s_hi = shares[hi - 1], shares[hi]
        w = (1 / sms - 1 / s_hi) / (1 / s_lo - 1 / s_hi)
        lo, up = self.share_params[s_lo], self.share_params[s_hi]
        return [w * x + (1 - w) * z for x, z in zip(lo, up, strict=True)]

    def _fold(self, sms: int) -> tuple[float, ...]:
        """Per-share coefficients over (1, kv_bytes, m, m^2, m^3),
        the slowdown over (1, b, kv_bytes), and b's."""
        a, c, d = self._params_at(sms)
        g1, g2, g3, g4 = self.solo_global
        e1, e2 = self.slow_global
        kvb = self.kv_bytes_per_token
        return (a, c * kvb, g1 / sms, g2 / sms, g3 / sms, d, e1, e2 * kvb, g4)

    def _row(self, sms: int) -> tuple[float, ...]:
        row = self._rows.get(sms)
        if row is None:
            row = self._rows[sms] = self._fold(sms)
        return row

    def predict(
        self,
        batch: int,
        kv_tokens: int,
        infer_sms: int,
        corun: bool = True,
        raw: bool = False,
        lora_slots: int = 0,
    ) -> float:
        """Seconds for one decode step of ``batch`` sequences reading ``kv_tokens`` cached tokens in all, its
        rows running ``lora_slots`` distinct adapters
        (0: the base only; unmodelled without a LoRA profile)."""
        row = self._rows.get(infer_sms) or self._row(infer_sms)
        b = batch if batch <= self.batch_max else self.batch_max
        m = gemv_rows(b, infer_sms, self.fma_min_sms)
        t = row[0] + row[1] * kv_tokens + m * (row[2] + m * (row[3] + m * row[4])) + b * row[8]
        if batch > b:  # past the profiled batches: assume linear growth, which overestimates (safe side)
            t *= batch / b
        if lora_slots and self.lora is not None:
            t += self.lora.seconds(infer_sms, lora_slots)
        if corun:
            t *= 1.0 + self.intensity * (row[5] + row[6] * batch + row[7] * kv_tokens)
        if raw:
            return t
        return t * self.correction(infer_sms, corun)

    def predict_mixed(
        self,
        batch: int,
        kv_tokens: int,
        prefill_tokens: int,
        attn_pairs: int,
        infer_sms: int,
        corun: bool = True,
        raw: bool = False,
        lora_slots: int = 0,
    ) -> float:
        """Seconds for one mixed step: ``batch`` decode rows reading ``kv_tokens`` cached tokens and prefill
        chunks of ``prefill_tokens`` tokens whose attention covers ``attn_pairs`` query-key pairs, its rows
        (decode rows and chunks) on ``lora_slots`` distinct adapters. Needs a profile with mixed samples
        (``self.mixed``). The adapters' part is ``mixed_lora``'s, priced by the step's rows, plus LoRACost's
        per further adapter; a profile without mixed adapter steps prices them as in a decode step."""
        if self.mixed is None:
            raise ValueError("this profile has no mixed-step samples: re-profile to predict mixed steps")
        t = self.mixed.predict(batch, kv_tokens, prefill_tokens, attn_pairs, infer_sms, corun)
        if lora_slots and self.mixed_lora is not None:
            extra = self.mixed_lora.seconds(infer_sms, batch + prefill_tokens)
            if self.lora is not None and lora_slots > 1:
                extra += self.lora.seconds(infer_sms, lora_slots) - self.lora.seconds(infer_sms, 1)
            t += extra * (1.0 + self.mixed.slowdown_at(infer_sms)) if corun else extra
        elif lora_slots and self.lora is not None:
            t += self.lora.seconds(infer_sms, lora_slots)
        return t if raw else t * self.correction(infer_sms, corun, mixed=True)

    def pad_to(self, buckets: Sequence[int]) -> None:
        """Predict mixed steps padded to ``buckets``, the token buckets of the engine that will run them
        (ascending; () where it runs them eagerly, unpadded). The model was fitted on the rows its profile's
        engine padded to; as a line in the padded rows it prices any bucket, so an engine whose buckets
        changed since the profile is predicted on its own buckets (its largest also bounds a chunk:
        ``policy.base.graph_room``) rather than on buckets it does not have."""
        if self.mixed is not None:
            self.mixed.buckets = tuple(int(b) for b in buckets)
        if self.mixed_lora is not None:
            self.mixed_lora.buckets = tuple(int(b) for b in buckets)

    def predict_all_shares(
        self, batch: int, kv_tokens: int, corun: bool = True, shares: Iterable[int] | None = None
    ) -> list[tuple[int, float]]:
        """``(sms, seconds)`` for every share (the profiled ones unless given), ascending in SMs."""
        return [(s, self.predict(batch, kv_tokens, s, corun)) for s in (shares or self.shares)]

    # --- evaluation and persistence --------------------------------------------------------------------

    def evaluate(self, samples: Sequence[dict], prefix: str = "") -> dict[str, float]:
        """Mean and max absolute percentage error of the uncorrected model: decode solo and co-run, and mixed
        steps (samples with ``prefill_tokens``) when the model has them; steps on adapters are left out (the
        adapter terms are fitted as differences from them, not predicted for them)."""
        mixed = [r for r in samples if "prefill_tokens" in r and not r.get("lora_slots")]
        samples = [r for r in samples if "prefill_tokens" not in r and not r.get("lora_slots")]
        out: dict[str, float] = {}
        for name, want in (("solo", False), ("corun", True)):
            errs = [
                abs(
                    self.predict(r["batch"], r["kv_tokens"], r["infer_sms"], want, raw=True) / r["latency_s"]
                    - 1
                )
                for r in samples
                if bool(r["corun"]) == want
            ]
            if errs:
                out[f"{prefix}{name}_mape_pct"] = 100.0 * sum(errs) / len(errs)
                out[f"{prefix}{name}_max_ape_pct"] = 100.0 * max(errs)
                out[f"{prefix}{name}_n"] = len(errs)
        if mixed and self.mixed is not None:
            out.update(self.mixed.evaluate(mixed, prefix))
        return out

    def effective_bandwidth(self) -> dict[int, float]:
        """Bytes/s each profiled share drew for the KV read (1 / C[s])."""
        return {s: (1.0 / p[1] if p[1] > 0 else math.inf) for s, p in self.share_params.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_sms": self.total_sms,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "shares": list(self.shares),
            "share_params": {str(s): list(p) for s, p in self.share_params.items()},
            "solo_global": list(self.solo_global),
            "batch_terms": BATCH_TERMS,
            "slow_global": list(self.slow_global),
            "batch_max": self.batch_max,
            "alpha": self.alpha,
            "alpha_up": self.alpha_up,
            "idle_alpha": self.idle_alpha,
            "intensity": self.intensity,
            "fma_min_sms": self.fma_min_sms,
            "fit_report": dict(self.fit_report),
            "corrections": {str(s): list(c) for s, c in self._corr.items()},
            "gpu_correction": list(self._glob),
            "mixed": None if self.mixed is None else self.mixed.to_dict(),
            "lora": None if self.lora is None else self.lora.to_dict(),
            "mixed_lora": None if self.mixed_lora is None else self.mixed_lora.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyPredictor:
        if d.get("batch_terms") != BATCH_TERMS:
            raise ValueError(
                "this predictor was fitted with other batch terms than gemv_rows' (an older harli-train): "
                "refit it from its profile"
            )
        pred = cls(
            int(d["total_sms"]),
            float(d["kv_bytes_per_token"]),
            [int(s) for s in d["shares"]],
            {int(s): [float(x) for x in p] for s, p in d["share_params"].items()},
            [float(x) for x in d["solo_global"]],
            [float(x) for x in d["slow_global"]],
            int(d["batch_max"]),
            alpha=float(d.get("alpha", 0.1)),
            alpha_up=float(d.get("alpha_up", 0.5)),
            idle_alpha=float(d.get("idle_alpha", 0.02)),
            intensity=float(d.get("intensity", 1.0)),
            fma_min_sms=int(d.get("fma_min_sms", 0)),  # saved before it was kept: FMAs on every share
            fit_report=dict(d.get("fit_report", {})),
            mixed=MixedStepModel.from_dict(d["mixed"]) if d.get("mixed") else None,
            lora=LoRACost.from_dict(d["lora"]) if d.get("lora") else None,
            mixed_lora=MixedLoRACost.from_dict(d["mixed_lora"]) if d.get("mixed_lora") else None,
        )
        pad = lambda c: [float(x) for x in c] + [1.0] * (4 - len(c))  # files of two families (decode only)
        pred._corr = {int(s): pad(c) for s, c in d.get("corrections", {}).items()}
        pred._glob = pad(d.get("gpu_correction", ()))
        return pred


def split_samples(samples: Sequence[dict], train_fraction: float = 0.7, seed: int = 0) -> tuple[list, list]:
    """A seeded random split into fitting and held-out samples."""
    idx = np.random.default_rng(seed).permutation(len(samples))
    n = int(round(train_fraction * len(samples)))
    return [samples[i] for i in idx[:n]], [samples[i] for i in idx[n:]]
