"""TrainerRungs: the rungs harli's trainer launches on, and the one that trails decode's recent peak share."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from harli_train.colocate.sm import Partition, SMLadder


class TrainerRungs:
    """Every ``stride``-th spatial rung, counted down from the largest decode share (the rung with the least
    trainer SMs is always one), at most as many as the memory holds streams for, and a window of the decode
    shares of the last ``window_s``.

    Why a subset: torch's caching allocator hands a freed block out again only on the stream that allocated
    it, so each trainer stream grows its own copy of the trainer's working set. Which subset (``limit``): the
    rungs beside the decode shares the objective calls for most, since a decode share without its rung sends
    the trainer down to the next rung kept, and at the shares decode holds most of the time that costs it
    most. Why trail the window's peak: autograd runs a chunk's backward on the stream its forward ran on, so a
    forward launched on SMs decode takes back a few steps later strands its backward; the complement of the
    recent peak keeps the usual ups and downs of the share from doing that. The trainer gives up the SMs
    between its rung and decode's share. A mixed step's share stays out of the window (``beside``): a
    one-step detour moves the trainer for that step only (bench/results/README.md has the H200 steps behind
    it)."""

    def __init__(
        self,
        ladder: SMLadder,
        stride: int,
        window_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if stride < 1:
            raise ValueError(f"harli: trainer_stride must be >= 1, got {stride}")
        self.ladder, self.window_s, self.clock = ladder, window_s, clock
        self.restride(stride)
        self.recent: deque[tuple[float, int]] = deque()  # (time, decode SMs) of recent spatial steps

    def restride(self, stride: int) -> None:
        """Launch on every ``stride``-th spatial rung from now on."""
        self.stride = stride
        self.rungs: list[Partition] = self.ladder.spatial[::-1][::stride][::-1]  # ascending decode share

    def limit(self, count: int, weights: Mapping[int, float] | None = None) -> bool:
        """Keep at most ``count`` (>= 1) rungs; whether any was dropped. With ``weights`` (decode share ->
        how much the load calls for it): the rung with the least trainer SMs (clear of every spatial decode
        share), then the rungs of the heaviest shares, a larger share first among equals. Without: evenly
        spread (the stride grown)."""
        count = max(count, 1)
        if len(self.rungs) <= count:
            return False
        if weights is None:
            n, stride = len(self.ladder.spatial), self.stride
            while -(-n // stride) > count:
                stride += 1
            self.restride(stride)
            return True
        last, others = self.rungs[-1], self.rungs[:-1]
        ranked = sorted(others, key=lambda p: (-weights.get(p.infer_sms, 0.0), -p.infer_sms))
        kept = {p.infer_sms for p in ranked[: count - 1]} | {last.infer_sms}
        self.rungs = [p for p in self.rungs if p.infer_sms in kept]
        return True

    def select(self, decode_sms: int) -> Partition:
        """The rung with the most trainer SMs that leaves decode at least ``decode_sms`` (the full GPU past
        the largest)."""
        for p in self.rungs:
            if p.infer_sms >= decode_sms:
                return p
        return self.ladder.full

    def trail(self, decode_sms: int | None) -> Partition | None:
        """Record a step on ``decode_sms`` (None: none) and return the rung clear of every decode share of the
        window (None: nothing recent)."""
        now = self.clock()
        if decode_sms is not None:
            self.recent.append((now, decode_sms))
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()
        if not self.recent:
            return None
        return self.select(max(sms for _, sms in self.recent))

    def beside(self, decode_sms: int) -> Partition:
        """The rung clear of ``decode_sms`` and of every decode share of the window, without recording
        ``decode_sms``: a transient step's share (a mixed step, a one-step detour) moves the trainer for that
        step only."""
        recent = self.trail(None)
        return self.select(decode_sms if recent is None else max(decode_sms, recent.infer_sms))

    def clear_of(self, trainer: Partition, share: int | None) -> Partition:
        """``trainer``, or the rung clear of decode ``share`` too when ``trainer`` is not and some rung is."""
        if share is None or trainer.infer_sms >= share or not self.rungs or share > self.rungs[-1].infer_sms:
            return trainer
        return self.select(share)
