"""RuntimeOptions: how a co-located run ends, reports and shares the host (the runtime's knobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harli_train.colocate.gauges import GaugeBoard


@dataclass(slots=True)
class RuntimeOptions:
    """How a co-located run ends and reports."""

    until: str = "train"  # "train": when training is done; "load": when the load's window closes
    window_s: float | None = None  # "load": seconds of load to serve (default: up to the last arrival)
    drain_s: float = 30.0  # "train": how long running requests may finish once training is done
    solo_s: float = 10.0  # "load" + exclusive: seconds the trainer then runs alone
    time_scale: float = 1.0  # arrival times are multiplied by this
    progress_every_s: float = 2.0
    quiet: bool = False
    finish: bool = True  # checkpoint and adapter at the end (benchmarks skip them)
    plots: bool = True
    max_decode_ooms: int = 3  # consecutive decode-side OOMs before giving up
    # Trainer OOMs in a row with decode idle (the memory hook freeing what it can after each) before the
    # run stops as "out_of_memory": nothing left to wait for, the trainer cannot fit.
    max_solo_ooms: int = 6
    # Launch the trainer's micro-steps from a thread of their own, so their host time does not delay decode
    # steps (None: on a GPU). Off, the decode thread launches them between its steps (time-sliced host).
    trainer_thread: bool | None = None
    switch_interval_s: float = 1e-4  # the GIL hand-over interval while the trainer thread runs
    max_in_flight: int = 2  # trainer micro-steps queued on the GPU at most (TrainerSide.max_in_flight)
    # With the trainer thread: a queued micro-step that ends between decode's decisions makes room for the
    # next at once, under the plan in force (TrainerWorker.refill); off: only the next plan's round does.
    refill: bool = False
    # With the trainer thread: the decode thread has the host to itself while it readies and launches a step
    # (the trainer's launches wait meanwhile; harli_train.colocate.host_priority).
    host_priority: bool = True
    # While serving, the decode thread alone on a CPU core (and its hyperthread siblings), the process's other
    # threads on the rest (harli_train.colocate.decode_core); off until measured.
    decode_core: bool = False
    # Python's cyclic collector runs where the decode thread would only wait (a step on the GPU, nothing to
    # decode) instead of wherever an allocation trips it (harli_train.colocate.gc_pauses); off: CPython's own.
    scheduled_gc: bool = True
    # Steps launched one ahead (the recipe's colocation.launch_ahead when None; ColocatedRuntime._step).
    launch_ahead: bool | None = None
    # HTTP clients' requests enter through this port (serve.engine_loop.RequestPort), drained before every
    # engine step and published after it; with serve_until_stopped the loop serves them until it is stopped,
    # training done or not (``--serve``), else until training is done and they have finished.
    port: Any = None
    serve_until_stopped: bool = False
    grace_s: float = 10.0  # stopped with a port: its running requests get this long to finish
    gauges: GaugeBoard | None = None  # live figures published for other threads (the server's /metrics)

    def __post_init__(self) -> None:
        if self.until not in ("train", "load"):
            raise ValueError(f"RuntimeOptions.until must be 'train' or 'load', got {self.until!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"RuntimeOptions.max_in_flight must be >= 1, got {self.max_in_flight}")
