"""Live figures of a co-located run for readers on other threads (the HTTP front end's ``/metrics``).

The runtime's loop is the one writer: every ``every_s`` it builds an immutable ``RuntimeGauges`` and swaps it
into a ``GaugeBoard``; a reader takes the latest snapshot as it is, never a half-updated one.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class RuntimeGauges:
    """One snapshot of the run: the trainer's progress and share, decode's share and the objective so far."""

    train_step: int
    train_total_steps: int
    train_loss: float
    trainer_tokens_per_s: float
    decode_sms: int
    trainer_sms: int
    total_sms: int
    token_intervals: int
    objective_violations: int
    violation_rate: float
    trainer_paused_fraction: float

    def metrics(self) -> dict[str, float]:
        """The snapshot as Prometheus gauges, named ``harli_<field>``."""
        return {f"harli_{k}": float(v) for k, v in asdict(self).items()}


class GaugeBoard:
    """The latest ``RuntimeGauges``; ``publish`` from the runtime's thread, ``metrics`` from any thread."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self._latest: RuntimeGauges | None = None
        self._lock = threading.Lock()

    def publish(self, gauges: RuntimeGauges) -> None:
        with self._lock:
            self._latest = gauges

    def latest(self) -> RuntimeGauges | None:
        with self._lock:
            return self._latest

    def metrics(self) -> dict[str, float]:
        """The latest snapshot's gauges ({} before the first)."""
        latest = self.latest()
        return {} if latest is None else latest.metrics()
