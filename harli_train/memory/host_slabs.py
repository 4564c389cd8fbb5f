"""HostSlabs: the host memory spilled stashes go to, in slabs kept for the run."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

# Spilled bytes go to host slabs of this size, kept for the run and reused (`HostSlabs`).
SLAB_BYTES = 64 << 20


class HostSlabs:
    """Host staging for spilled stashes: slabs of ``slab_bytes`` (pinned on CUDA) taken for a spill, given
    back once its bytes are on the device again, and kept for the run. Pinning host memory page-locks it
    and registers it with the driver (a few GB/s, the driver busy meanwhile), so only a spill larger than
    any before pays it; ``reserve`` pays it ahead, at set-up.

    On CUDA every copy into or out of a slab runs on the swapper's side stream, so a slab given back while
    a copy out of it is still queued is safe to take again: the next copy into it is queued after."""

    def __init__(self, slab_bytes: int = SLAB_BYTES, pinned: bool = False) -> None:
        self.slab_bytes, self.pinned = slab_bytes, pinned
        self._free: list[torch.Tensor] = []
        self.count = 0  # slabs made, free or taken
        self.pin_seconds = 0.0  # host seconds spent making them

    @property
    def nbytes(self) -> int:
        return self.count * self.slab_bytes

    def reserve(self, nbytes: int) -> int:
        """Make slabs until ``nbytes`` are held (free or taken), as far as the host lets: a slab that cannot
        be made (pinned memory refused: the host's RAM or its locked-memory limit) ends the reserve with a
        warning, and spills pin what they need later. Returns the bytes held."""
        while self.nbytes < nbytes:
            try:
                self._free.append(self._make())
            except RuntimeError as err:  # torch's pinned allocation refused (OutOfMemoryError included)
                log.warning(
                    "pinned %.2f GiB of the %.2f GiB of host slabs wanted for the trainer's spills (%s); "
                    "spills pin more as they need it",
                    self.nbytes / 2**30,
                    nbytes / 2**30,
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                )
                break
        return self.nbytes

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """Slabs that hold ``nbytes`` together (the first ones full, the last one part)."""
        need = -(-nbytes // self.slab_bytes)
        while len(self._free) < need:
            self._free.append(self._make())
        taken, self._free = self._free[:need], self._free[need:]
        return taken

    def give(self, slabs: list[torch.Tensor]) -> None:
        self._free.extend(slabs)

    def copy_out(self, src: torch.Tensor, slabs: list[torch.Tensor]) -> None:
        """``src`` (uint8) into ``slabs``, slab by slab (asynchronous from the device)."""
        for i, slab in enumerate(slabs):
            part = src[i * self.slab_bytes : (i + 1) * self.slab_bytes]
            slab[: part.numel()].copy_(part, non_blocking=True)

    def copy_in(self, slabs: list[torch.Tensor], dst: torch.Tensor) -> None:
        """``slabs`` back into ``dst`` (uint8), as ``copy_out`` laid them."""
        for i, slab in enumerate(slabs):
            part = dst[i * self.slab_bytes : (i + 1) * self.slab_bytes]
            part.copy_(slab[: part.numel()], non_blocking=True)

    def _make(self) -> torch.Tensor:
        t0 = time.perf_counter()
        slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.pin_seconds += time.perf_counter() - t0
        self.count += 1
        return slab
