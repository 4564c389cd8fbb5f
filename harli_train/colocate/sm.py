"""The SM ladder: disjoint inference/finetune partitions of one GPU, created once at start-up.

Every rung is a pair of green contexts made by one ``cuDevSmResourceSplitByCount`` call: inference gets
the first k minimal SM groups, finetune the remaining groups (and the split's remainder), so the two sets
are disjoint and complementary. torch's ``GreenContext.create`` is not used: on torch 2.11 each context
takes SMs from the start of the device and two of them overlap (docs/design.md). A last "full" rung gives
decode the whole GPU on an ordinary stream, for when the trainer is paused.

Switching partitions at run time is choosing a stream pair and handing work off with events; nothing is
created after start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class GreenContextUnavailable(RuntimeError):
    """The GPU, the driver or cuda-bindings cannot make green contexts; use ``TimeSliceLadder``."""


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """One rung: decode runs on ``infer_stream`` (``infer_sms`` SMs), the trainer on ``train_stream``.

    ``train_sms == 0`` marks the full-GPU rung (trainer paused); ``infer_stream is train_stream`` marks
    time slicing (both sides share the whole GPU and alternate).
    """

    infer_sms: int
    train_sms: int
    infer_stream: Any
    train_stream: Any
    index: int = 0
    infer_event: Any = None  # recorded on infer_stream when decode leaves this rung (``SMLadder.switch``)

    @property
    def exclusive(self) -> bool:
        return self.train_sms == 0

    @property
    def time_sliced(self) -> bool:
        return self.infer_stream is self.train_stream

    def __repr__(self) -> str:
        return f"Partition(infer_sms={self.infer_sms}, train_sms={self.train_sms}, index={self.index})"


class StandInEvent:
    """CPU stand-in for ``torch.cuda.Event``: remembers which stream it was last recorded on."""

    __slots__ = ("stream", "records")

    def __init__(self) -> None:
        self.stream: StandInStream | None = None
        self.records = 0

    def record(self, stream: StandInStream | None = None) -> None:
        self.stream = stream
        self.records += 1

    def synchronize(self) -> None:
        pass


class StandInStream:
    """CPU stand-in for a green-context stream; ``sm_ids`` are the SMs it would be confined to."""

    __slots__ = ("name", "sm_ids", "waits")

    def __init__(self, name: str, sm_ids: frozenset[int]) -> None:
        self.name = name
        self.sm_ids = sm_ids
        self.waits: list[StandInEvent] = []

    def wait_event(self, event: StandInEvent) -> None:
        self.waits.append(event)

    def record_event(self, event: StandInEvent | None = None) -> StandInEvent:
        event = event or StandInEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"StandInStream({self.name}, {len(self.sm_ids)} SMs)"


def is_cuda_stream(stream: Any) -> bool:
    """Whether ``stream`` is a CUDA stream (a partition's on a GPU) rather than a CPU ``StandInStream``."""
    import torch

    return isinstance(stream, torch.cuda.Stream)


@dataclass(slots=True)
class SMLadder:
    """Pre-created partitions, ascending in inference SMs, the full-GPU rung last."""

    partitions: list[Partition]
    total_sms: int
    kind: str = "green"
    device: int = 0
    time_sliced: bool = False
    _owned: list[Any] = field(default_factory=list, repr=False)  # green contexts and raw streams to free
    _driver: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.partitions:
            raise ValueError("an SM ladder needs at least one partition")
        self.partitions.sort(key=lambda p: (p.infer_sms, -p.train_sms))
        for i, p in enumerate(self.partitions):
            object.__setattr__(p, "index", i)

    @property
    def shares(self) -> list[int]:
        """Inference SM counts of all rungs, ascending (the full GPU last)."""
        return [p.infer_sms for p in self.partitions]

    @property
    def spatial(self) -> list[Partition]:
        """Rungs where the trainer runs beside decode on its own SMs."""
        return [p for p in self.partitions if p.train_sms > 0 and not p.time_sliced]

    @property
    def full(self) -> Partition:
        """Decode alone on the whole GPU (trainer paused, or time-sliced)."""
        return self.partitions[-1]

    def select(self, infer_sms: int) -> Partition:
        """The smallest rung that gives decode at least ``infer_sms`` SMs (the full GPU past the top)."""
        for p in self.partitions:
            if p.infer_sms >= infer_sms:
                return p
        return self.full

    def switch(self, prev: Partition | None, nxt: Partition) -> Partition:
        """Hand decode's queued work from ``prev``'s stream to ``nxt``'s (no sync): decode on the new rung
        sees the KV writes of the last step.

        The trainer's streams are not touched: the trainer orders its own work across streams on its own
        thread (``TrainerSide._handoff``), and may be capturing a CUDA graph on one of them, where an event
        recorded or waited on from the decode thread would join or break that capture."""
        if prev is None or prev is nxt:
            return nxt
        prev.infer_event.record(prev.infer_stream)
        nxt.infer_stream.wait_event(prev.infer_event)
        return nxt

    def retire(self, train_sms: set[int]) -> list[Partition]:
        """Drop the spatial rungs whose trainer side has one of these SM counts (the trainer's kernels failed
        there); returns them. The full-GPU rung stays; the rest keep their order and are re-indexed."""
        gone = [p for p in self.partitions if p.train_sms in train_sms and p is not self.full]
        if gone:
            self.partitions = [p for p in self.partitions if p not in gone]
            self.__post_init__()
        return gone

    def describe(self) -> list[dict[str, int]]:
        return [{"infer_sms": p.infer_sms, "train_sms": p.train_sms} for p in self.partitions]

    def close(self) -> None:
        """Destroy the driver streams and green contexts (GPU ladders only)."""
        if not self._owned:
            return
        import gc

        import torch

        # Work still queued on these streams, and torch events recorded on them, must be gone before the
        # contexts are: destroying first ends the process in a 'context is destroyed' abort. Freed pinned
        # buffers hold such events until the pinned-memory cache is emptied.
        gc.collect()
        if torch.cuda.is_available():  # (a test's fake driver has no GPU behind it)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
            if host_empty_cache is not None:
                host_empty_cache()
        cu = self._driver
        for kind, handle in reversed(self._owned):
            if kind == "stream":
                cu.cuStreamDestroy(handle)
            else:
                cu.cuGreenCtxDestroy(handle)
        self._owned.clear()

    def __enter__(self) -> SMLadder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def cpu_standin(cls, total_sms: int = 132, step: int = 8, group_sms: int | None = None) -> SMLadder:
        """A ladder with the GPU ladder's arithmetic and stand-in streams, for tests and dry runs."""
        group = group_sms or step
        sizes = [group] * (total_sms // group)
        everything = frozenset(range(total_sms))

        def pair(k: int | None) -> Partition:
            infer_ids = everything if k is None else frozenset(range(sum(sizes[:k])))
            train_ids = everything if k is None else everything - infer_ids
            return Partition(
                len(infer_ids),
                0 if k is None else len(train_ids),
                StandInStream(f"infer{len(infer_ids)}", infer_ids),
                StandInStream(f"train{len(train_ids)}", train_ids),
                infer_event=StandInEvent(),
            )

        return cls._from_groups(sizes, total_sms, step, pair, kind="cpu")

    @classmethod
    def create(cls, step: int = 8, device: int = 0, infer_priority: int = -1) -> SMLadder:
        """Build every rung through ``cuda.bindings.driver``; ``GreenContextUnavailable`` if impossible."""
        return cls._build(_GreenBuilder(device, infer_priority), step)

    @classmethod
    def _build(cls, builder: _GreenBuilder, step: int) -> SMLadder:
        try:
            sizes, total = builder.split()
            ladder = cls._from_groups(sizes, total, step, builder.pair, kind="green", device=builder.device)
        except BaseException:
            builder.free()
            raise
        ladder._owned = builder.owned
        ladder._driver = builder.cu
        log.info(
            "SM ladder (inference/finetune SMs granted): %s",
            ", ".join(f"{p.infer_sms}/{p.train_sms}" for p in ladder.partitions),
        )
        return ladder

    @classmethod
    def _from_groups(
        cls, sizes: list[int], total_sms: int, step: int, make_pair, kind: str, device: int = 0
    ) -> SMLadder:
        """Rung k: groups[:k] for decode, groups[k:] + remainder for the trainer, at multiples of step."""
        parts, infer = [], 0
        for k in range(1, len(sizes) + 1):
            infer += sizes[k - 1]
            if infer < total_sms and infer % step == 0:
                parts.append(make_pair(k))
        parts.append(make_pair(None))
        return cls(parts, total_sms, kind=kind, device=device)


class TimeSliceLadder(SMLadder):
    """Fallback without green contexts: one partition, both sides on the whole GPU and one stream.

    The controller treats it as alternation: a trainer micro-step may run between two decode steps only
    when the decode step plus the micro-step still meet the TPOT objective.
    """

    __slots__ = ()

    @classmethod
    def create(cls, step: int = 8, device: int = 0, infer_priority: int = -1) -> TimeSliceLadder:
        import torch

        total = torch.cuda.get_device_properties(device).multi_processor_count
        stream = torch.cuda.Stream(device=device, priority=infer_priority)
        event = torch.cuda.Event()
        part = Partition(total, total, stream, stream, infer_event=event)
        return cls([part], total, kind="timeslice", device=device, time_sliced=True)

    @classmethod
    def cpu_standin(
        cls, total_sms: int = 132, step: int = 8, group_sms: int | None = None
    ) -> TimeSliceLadder:
        stream = StandInStream("timeslice", frozenset(range(total_sms)))
        event = StandInEvent()
        part = Partition(total_sms, total_sms, stream, stream, infer_event=event)
        return cls([part], total_sms, kind="timeslice-cpu", time_sliced=True)


def make_ladder(step: int = 8, device: int = 0, fallback: bool = True) -> SMLadder:
    """The green-context ladder, or (with ``fallback``) a time-slicing ladder and a warning saying why."""
    try:
        return SMLadder.create(step=step, device=device)
    except GreenContextUnavailable as err:
        if not fallback:
            raise
        log.warning("%s; falling back to time slicing on one stream", err)
        return TimeSliceLadder.create(step=step, device=device)


class _GreenBuilder:
    """Driver calls for one ladder; remembers what it created so a failure frees it all."""

    def __init__(self, device: int, infer_priority: int, cu: Any = None, torch: Any = None) -> None:
        if cu is None:  # imported here so that importing this module never needs a GPU stack
            try:
                from cuda.bindings import driver as cu
            except ImportError as err:
                raise GreenContextUnavailable(f"cuda-bindings is not importable ({err})") from err
        if torch is None:
            import torch
        if not torch.cuda.is_available():
            raise GreenContextUnavailable("torch sees no CUDA device; green contexts need a GPU")
        torch.zeros(1, device=f"cuda:{device}")  # make the primary context current before the driver calls
        self.cu, self.torch, self.device = cu, torch, device
        self.infer_priority = infer_priority
        self.owned: list[tuple[str, Any]] = []
        self.driver_version = "unknown"
        self._call("cuInit", 0)
        v = self._call("cuDriverGetVersion")
        self.driver_version = f"{v // 1000}.{v % 1000 // 10}"
        self.dev = self._call("cuDeviceGet", device)

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.cu, name, None)
        if fn is None:
            raise GreenContextUnavailable(
                f"cuda-bindings has no {name} (driver CUDA {self.driver_version}); green contexts need "
                "cuda-bindings >= 12.4 and a driver with CUDA >= 12.4"
            )
        try:
            out = fn(*args)
        except Exception as err:  # the bindings raise when libcuda cannot be loaded at all
            raise GreenContextUnavailable(f"{name} failed: {err}") from err
        err = out[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise GreenContextUnavailable(
                f"{name} failed with {getattr(err, 'name', err)} (driver CUDA {self.driver_version}, "
                f"device {self.device})"
            )
        return out[1] if len(out) == 2 else (out[1:] if len(out) > 2 else None)

    def split(self) -> tuple[list[int], int]:
        """Split the device's SMs once into minimal groups; later rungs combine groups of this one call."""
        sm_type = self.cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        self.all_sms = self._call("cuDeviceGetDevResource", self.dev, sm_type)
        total = int(self.all_sms.sm.smCount)
        min_size = max(
            int(getattr(self.all_sms.sm, "minSmPartitionSize", 0) or 0),
            int(getattr(self.all_sms.sm, "smCoscheduledAlignment", 0) or 0),
            1,
        )
        n = max(total // min_size, 1)
        groups, n_made, self.remainder = self._call(
            "cuDevSmResourceSplitByCount", n, self.all_sms, 0, min_size
        )
        self.groups = list(groups)[: int(n_made)]
        if not self.groups:
            raise GreenContextUnavailable(f"cuDevSmResourceSplitByCount made no groups of {min_size} SMs")
        log.info(
            "split %d SMs into %d groups of %d (+%d left)",
            total,
            len(self.groups),
            min_size,
            self.remainder.sm.smCount,
        )
        return [int(g.sm.smCount) for g in self.groups], total

    def _context_stream(self, resources: list[Any], priority: int) -> tuple[Any, int]:
        """A green context over ``resources`` with one non-blocking stream; returns (stream, granted SMs)."""
        cu = self.cu
        desc = self._call("cuDevResourceGenerateDesc", resources, len(resources))
        flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        gctx = self._call("cuGreenCtxCreate", desc, self.dev, flags)
        self.owned.append(("ctx", gctx))
        raw = self._call("cuGreenCtxStreamCreate", gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, priority)
        self.owned.append(("stream", raw))
        granted = self._call("cuGreenCtxGetDevResource", gctx, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        stream = self.torch.cuda.ExternalStream(int(raw), device=self.torch.device("cuda", self.device))
        return stream, int(granted.sm.smCount)

    def pair(self, k: int | None) -> Partition:
        torch, total_sms = self.torch, int(self.all_sms.sm.smCount)
        if k is None:
            s_inf = torch.cuda.Stream(device=self.device, priority=self.infer_priority)
            s_tr = torch.cuda.Stream(device=self.device)
            return Partition(total_sms, 0, s_inf, s_tr, infer_event=torch.cuda.Event())
        train_res = self.groups[k:] + ([self.remainder] if self.remainder.sm.smCount > 0 else [])
        s_inf, n_inf = self._context_stream(self.groups[:k], self.infer_priority)
        s_tr, n_tr = self._context_stream(train_res, 0)
        return Partition(n_inf, n_tr, s_inf, s_tr, infer_event=torch.cuda.Event())

    def free(self) -> None:
        for kind, handle in reversed(self.owned):
            try:
                (self.cu.cuStreamDestroy if kind == "stream" else self.cu.cuGreenCtxDestroy)(handle)
            except Exception:  # best effort while unwinding another error
                pass
        self.owned.clear()
