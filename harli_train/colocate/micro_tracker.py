"""MicroTracker: what the trainer's micro-step generator has launched in the step under way.

It answers the questions the launch rules ask between micro-steps: what comes next (``next_kind``), whether
the next backward's forward ran on SMs decode now holds (``stale``: autograd runs a chunk's backward on the
stream its forward ran on, so such a backward is rebuilt, its forward run again from the saved input on the
current trainer stream), and how far the step has got (for the pro-rata token count).
"""

from __future__ import annotations

from harli_train.train.step import MicroStep, step_order


class MicroTracker:
    """Chunks, their forwards' first SMs and the next backward of the step under way; one owner."""

    def __init__(self, num_layers: int, layers_per_microstep: int, grad_accum: int) -> None:
        self.num_layers, self.grad_accum = num_layers, grad_accum
        self.order = step_order(num_layers, layers_per_microstep, grad_accum)
        self.position = {(m.phase, m.micro_batch, m.start): i for i, m in enumerate(self.order)}
        self.micro_steps = self.rebuilt_chunks = 0
        self.micro_per_step = 0  # micro-steps of the last whole step
        self.reset()

    def reset(self) -> None:
        """Forget the step under way (it is being redone from its first micro-step)."""
        self.last_phase: str | None = None
        self.last: MicroStep | None = None
        self.chunks: dict[int, list[tuple[int, int]]] = {}
        self.fwd_first_sm: dict[tuple[int, int], int] = {}
        self.next_bwd: tuple[int, int] | None = None
        self.rebuild: tuple[int, int] | None = None  # the backward chunk to rebuild at its launch
        self.micro_in_step = 0

    def next_kind(self) -> str:
        """What the generator launches next: fwd, loss, bwd, optim (`step_order`'s next micro-step), eval
        (while an evaluation runs: its next chunk, or the next step), or "next" (the step boundary)."""
        ms = self.last
        if ms is None or ms.phase == "optim":
            return "next"
        if ms.phase == "eval":
            return "eval"
        return self.order[self.position[(ms.phase, ms.micro_batch, ms.start)] + 1].phase

    def track(self, ms: MicroStep, first_sm: int) -> bool:
        """Record a launched micro-step whose SMs start at ``first_sm``; True when it completed the step."""
        self.micro_steps += 1
        self.last_phase, self.last = ms.phase, ms
        if ms.phase == "eval":  # a chunk of an evaluation after a counted step: no gradients to follow
            return False
        self.micro_in_step += 1
        mb = ms.micro_batch
        if ms.phase == "fwd":
            chunks = self.chunks.setdefault(mb, [])
            if ms.start == 0:
                chunks.clear()
            chunks.append((ms.start, ms.stop))
            self.fwd_first_sm[(mb, ms.start)] = first_sm
            self.next_bwd = None
        elif ms.phase == "loss":
            self.next_bwd = (mb, self.chunks[mb][-1][0])
        elif ms.phase == "bwd":
            chunks = self.chunks[mb]
            i = chunks.index((ms.start, ms.stop))
            self.next_bwd = (mb, chunks[i - 1][0]) if i > 0 else None
        else:  # optim: the step is complete
            self.micro_per_step, self.micro_in_step = self.micro_in_step, 0
            self.chunks.clear()
            self.fwd_first_sm.clear()
            self.next_bwd = None
            return True
        return False

    @property
    def mid_micro_batch(self) -> bool:
        """Whether a micro-batch is under way: its forward or loss launched, its last backward not yet."""
        last = self.last
        if last is None or last.phase not in ("fwd", "loss", "bwd"):
            return False
        return last.phase != "bwd" or last.start > 0

    def stale(self, decode_sms: int) -> bool:
        """Whether the next micro-step is a backward whose forward ran on SMs decode now holds."""
        if self.next_bwd is None:
            return False
        first_sm = self.fwd_first_sm.get(self.next_bwd)
        return first_sm is not None and first_sm < decode_sms

    def arm_rebuild(self, stale: bool) -> None:
        """The next launch rebuilds the next backward's chunk (``stale``) or not."""
        self.rebuild = self.next_bwd if stale else None

    def take_rebuild(self, micro_batch: int, start: int) -> bool:
        """The trainer asks, before a chunk's backward, whether to rebuild the chunk's forward first."""
        if self.rebuild != (micro_batch, start):
            return False
        self.rebuild = None
        self.rebuilt_chunks += 1
        self.fwd_first_sm.pop((micro_batch, start), None)
        return True

    def done_fraction(self, queued: int) -> float:
        """The share of the step under way that has run, ``queued`` of its micro-steps still on the GPU."""
        if not self.micro_per_step:
            return 0.0
        return min(max(self.micro_in_step - queued, 0) / self.micro_per_step, 1.0)
