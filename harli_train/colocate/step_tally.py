"""StepTally: what a co-located run counts as it goes, for its summary; ``step_row``: an engine step's record.

Engine steps by kind, the decode share of each step with decode rows, how long the trainer held each SM
count (plan to plan: what its shares were worth) and the run's phase marks (serve, drain, solo, end) with the
finetune tokens at each. One owner: the runtime's loop writes it; the summary reads it once the loop is over.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class StepTally:
    """Streaming counts of a run's engine steps and trainer shares (the per-step detail is steps.jsonl)."""

    def __init__(self, total_sms: int = 0) -> None:
        self.total_sms = total_sms
        self.decode_steps = self.mixed_steps = self.prefill_steps = self.paused_steps = 0
        self.launched_ahead = 0  # steps launched before their predecessor's tokens were read
        self.shares: Counter[int] = Counter()  # decode's SMs -> steps with decode rows on them
        self.trainer_sm_seconds: Counter[int] = Counter()  # the trainer's SMs (0: paused) -> seconds held
        # SM-seconds neither side held while the trainer ran: its rung below what decode's share left it.
        self.unused_sm_seconds = 0.0
        self.held_sms, self._held_since, self._held_unused = 0, 0.0, 0
        self.marks: list[tuple[str, float, float]] = []  # (phase, start time, finetune tokens at start)

    def mark(self, phase: str, t: float, tokens: float) -> None:
        """A phase of the run starts at ``t`` with ``tokens`` finetune tokens done."""
        self.marks.append((phase, t, tokens))

    def hold(self, t: float, sms: int, decode_sms: int | None = None) -> None:
        """From ``t`` the trainer holds ``sms`` SMs (0: none) beside decode's ``decode_sms`` (None: all the
        rest); closes the interval before."""
        dt = t - self._held_since
        self.trainer_sm_seconds[self.held_sms] += dt
        self.unused_sm_seconds += self._held_unused * dt
        unused = 0 if not sms or decode_sms is None else max(self.total_sms - decode_sms - sms, 0)
        self.held_sms, self._held_since, self._held_unused = sms, t, unused

    def start_holding(self, t: float) -> None:
        """The intervals are counted from ``t`` (the serving loop's start)."""
        self._held_since = t

    def count(self, kind: str, decode_rows: int, infer_sms: int, paused: bool) -> None:
        """One engine step of ``kind`` (decode, mixed or prefill) with ``decode_rows`` rows decoding."""
        if not decode_rows:
            self.prefill_steps += 1
            return
        self.decode_steps += 1
        self.mixed_steps += kind == "mixed"
        self.paused_steps += paused
        self.shares[infer_sms] += 1

    @property
    def paused_fraction(self) -> float:
        """The fraction of steps with decode rows that ran with the trainer paused."""
        return self.paused_steps / max(self.decode_steps, 1)

    def phases(self, end_tokens: float) -> dict[str, dict[str, float]]:
        """Seconds, finetune tokens and tokens/s per phase, the last mark closed at ``end_tokens``."""
        marks = list(self.marks)
        marks[-1] = (marks[-1][0], marks[-1][1], end_tokens)
        out = {}
        for (name, t0, tok0), (_, t1, tok1) in zip(marks, marks[1:], strict=False):
            secs = t1 - t0
            out[name] = {
                "seconds": secs,
                "finetune_tokens": tok1 - tok0,
                "finetune_tokens_per_s": (tok1 - tok0) / secs if secs > 0 else 0.0,
            }
        return out

    @property
    def duration_s(self) -> float:
        return self.marks[-1][1] - self.marks[0][1] if self.marks else 0.0

    def step_counts(self) -> dict[str, int]:
        return {
            "decode_steps": self.decode_steps,
            "mixed_steps": self.mixed_steps,
            "prefill_steps": self.prefill_steps,
            "launched_ahead_steps": self.launched_ahead,
        }

    def share_figures(self) -> dict[str, Any]:
        """The summary's share figures:
        paused fraction, decode's share histogram, the trainer's SM seconds."""
        steps = max(self.decode_steps, 1)
        return {
            "trainer_paused_fraction": self.paused_fraction,
            "share_histogram": {str(k): v for k, v in sorted(self.shares.items())},
            "trainer_sm_seconds": {
                str(k): round(v, 4) for k, v in sorted(self.trainer_sm_seconds.items()) if v > 0
            },
            "mean_infer_sms": sum(k * v for k, v in self.shares.items()) / steps,
            # The SMs decode's share left the trainer that its rung did not take (a rung the memory left
            # out, the trailing window), as a fraction of the GPU over the run.
            "unused_sm_fraction": (
                self.unused_sm_seconds / (self.total_sms * self.duration_s)
                if self.total_sms and self.duration_s > 0
                else 0.0
            ),
        }


def step_row(
    result: Any, plan: Any, measured_s: float, launched: int, trainer: Any, on_gpu: tuple[str, ...]
) -> dict[str, Any]:
    """An engine step's line of steps.jsonl: the engine's ``StepResult``, the ``StepPlan`` it ran under, its
    measured latency, the micro-steps launched beside it, the ``TrainerSnapshot`` taken before it ran and
    the kinds of the trainer's micro-steps still on the GPU as it started (``TrainerSnapshot.on_gpu``)."""
    return {
        "kind": result.kind,
        "batch": result.num_decode,
        "adapter_rows": result.adapter_rows,
        "kv_tokens": result.kv_tokens,
        "prefill_tokens": result.prefill_tokens,
        "infer_sms": plan.partition.infer_sms,
        "train_sms": 0 if plan.paused else plan.train_sms,
        "train": plan.train,
        "paused": plan.paused,
        "predicted_s": plan.predicted_s,
        "mixed_raw_s": plan.mixed_raw_s,  # a mixed step's uncorrected prediction (predicted_s / correction)
        "measured_s": measured_s,
        "gpu_s": result.gpu_s,
        "launch_s": result.launch_s,
        "forward_launch_s": result.forward_launch_s,
        "micro_steps": launched,
        "trainer_launching": trainer.in_round,
        "trainer_phase": trainer.launching_kind if trainer.in_round else None,
        "trainer_queue": "+".join(on_gpu),
        "reason": plan.reason,
    }
