"""The device buffers a micro-batch's inputs are copied into:
allocated once per shape, refilled every time."""

from __future__ import annotations

import torch

# The per-token inputs of a batch (harli_train.data.loader), all LongTensor [B, T].
KEYS = ("input_ids", "labels", "positions", "doc_ids")


class BatchBuffers:
    """Static device buffers for the per-token tensors of the batches a trainer runs (`KEYS`).

    `load(batch)` copies a batch's tensors into buffers kept per (key, shape), so every micro-batch of a run
    reads its token ids, labels, positions and document ids from the same addresses: nothing is allocated for
    them once the first batch of each shape has been seen (co-located, an allocation may wait on decode's
    stream), and a captured CUDA graph of a micro-step can read them in place. A buffer is overwritten by the
    next `load` of its shape: callers finish with one micro-batch (forward and backward) before loading the
    next, as `train_step` does. Copies are queued on the current stream, after whatever read the buffers
    before.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def load(self, batch: dict) -> dict:
        """`batch` with its `KEYS` tensors replaced by device buffers holding the same values."""
        out = dict(batch)
        for key in KEYS:
            src = batch.get(key)
            if src is None:
                continue
            buf = self._buffers.get((key, tuple(src.shape)))
            if buf is None:
                buf = torch.empty(src.shape, dtype=torch.long, device=self.device)
                self._buffers[(key, tuple(src.shape))] = buf
            out[key] = buf.copy_(src, non_blocking=True)
        return out

    def release(self) -> None:
        """Drop every buffer (the next `load` of a shape makes its buffers again)."""
        self._buffers.clear()

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)
