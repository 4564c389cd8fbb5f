"""How long the trainer holds back after running out of memory beside the engine.

A failure abandons the trainer's step (`TrainerSide.recover_oom`); ``retries`` failures in a row pause it for
``base`` decode decisions, and every further pause before a step completes doubles that, up to
``2**max_doublings`` times ``base``. A pool that stays full (a long-context burst holding the KV cache's
pages) is then not paid for again and again: each retry's forward stashes activations that the cache's next
grow spills to host memory, and the step fails anyway. A completed step starts over from ``base``.
"""

from __future__ import annotations


class OomBackoff:
    """Counts the trainer's out-of-memory failures and says how long to hold it back after each."""

    def __init__(self, retries: int = 3, base: int = 64, max_doublings: int = 4) -> None:
        if retries < 1 or base < 0 or max_doublings < 0:
            raise ValueError("OomBackoff: need retries >= 1, base >= 0, max_doublings >= 0")
        self.retries, self.base, self.max_doublings = retries, base, max_doublings
        self.streak = 0  # failures since the last pause or completed step
        self.doublings = 0  # pauses since the last completed step
        self.pauses = 0  # pauses in all

    def failed(self) -> int:
        """One failure more: the decode decisions to hold the trainer back for (0: retry at once)."""
        self.streak += 1
        if self.streak < self.retries:
            return 0
        hold = self.base << min(self.doublings, self.max_doublings)
        self.streak = 0
        self.doublings += 1
        self.pauses += 1
        return hold

    def completed(self) -> None:
        """A step completed: the next failure starts over."""
        self.streak = self.doublings = 0
