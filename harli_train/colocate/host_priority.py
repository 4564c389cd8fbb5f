"""The decode thread's priority over the trainer thread for the host, while it readies and launches a step.

Both threads run Python, so they take turns on the GIL. While the decode thread prepares and launches a step,
every time it lets the GIL go (a CUDA call, a copy) it waits for the trainer thread to hand it back, which is
at best one switch interval later and at worst after whatever C call the trainer is in. Those waits add up
inside decode's critical path, and more so on a slower host (docs/design.md, "Measured facts behind the
defaults").

``HostPriority`` is a gate: the decode thread holds it while it readies and launches a step, and opens it
while it waits for the GPU. Every Triton launcher calls ``harli_train.kernels.launch_config.launch_gate``
before its launch; in any thread but the holder's that waits while the gate is held. The trainer thread (and
autograd's backward threads) then sleep on an ``Event``, GIL released, and the decode thread has the host to
itself until it waits for the GPU. The trainer loses only host time: its queued GPU work keeps running.

A wait is bounded (``timeout_s``), so a holder that forgets to open the gate costs the trainer time, never a
deadlock; the decode thread also opens it around every wait for the trainer thread (``yielded``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class HostPriority:
    """A gate one thread holds; ``wait`` (the launch gate) blocks every other thread while it is held."""

    def __init__(self, timeout_s: float = 0.02) -> None:
        self.timeout_s = timeout_s
        self._open = threading.Event()
        self._open.set()
        self._owner: int | None = None
        self.waits = self.timeouts = 0
        self.wait_s = 0.0

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    def hold(self) -> None:
        """The calling thread takes the host: other threads' launches wait until ``release``."""
        self._owner = threading.get_ident()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait(self) -> None:
        """The launch gate: returns at once when open or in the holder's thread, else when it opens (or after
        ``timeout_s``)."""
        if self._open.is_set() or threading.get_ident() == self._owner:
            return
        t0 = time.perf_counter()
        opened = self._open.wait(self.timeout_s)
        self.wait_s += time.perf_counter() - t0
        self.waits += 1
        self.timeouts += not opened

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold for the block (it stays open after, whatever it was before)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def yielded(self) -> Iterator[None]:
        """Open the gate for the block if this thread holds it (it waits for the GPU or the trainer thread),
        and take it back after."""
        mine = self.held and threading.get_ident() == self._owner
        if mine:
            self.release()
        try:
            yield
        finally:
            if mine:
                self.hold()

    def stats(self) -> dict[str, float]:
        return {"waits": self.waits, "timeouts": self.timeouts, "wait_s": self.wait_s}
