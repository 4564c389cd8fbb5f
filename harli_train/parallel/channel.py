"""Rank 0's messages to the other ranks, as int64 tensors broadcast over a gloo group (nothing pickled).

A message is a kind, a few integers, a short text and up to eight integer arrays (1-D or 2-D): one
broadcast of a fixed header, then one of the payload when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

HEADER = 64
MAX_INTS, MAX_ARRAYS = 16, 8


@dataclass(slots=True)
class Message:
    kind: int
    ints: list[int] = field(default_factory=list)
    text: str = ""
    arrays: list[np.ndarray] = field(default_factory=list)


class Channel:
    """``send`` on rank ``src``, ``recv`` on the others, in the same order (a collective per message)."""

    def __init__(self, group: Any, src: int = 0):
        self.group, self.src = group, src

    def _bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=self.src, group=self.group)

    def send(self, kind: int, ints: Sequence[int] = (), text: str = "", arrays: Sequence[Any] = ()) -> None:
        arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
        if len(ints) > MAX_INTS or len(arrays) > MAX_ARRAYS or any(a.ndim > 2 for a in arrays):
            raise ValueError("channel: a message holds at most 16 ints and 8 arrays of 1 or 2 dims")
        raw = text.encode()
        header = np.zeros(HEADER, dtype=np.int64)
        header[:4] = kind, len(ints), len(arrays), len(raw)
        header[4 : 4 + len(ints)] = ints
        for i, a in enumerate(arrays):
            shape = (*a.shape, 1, 1)[:2] if a.ndim else (1, 1)
            header[20 + 3 * i : 23 + 3 * i] = a.ndim, *shape
        self._bcast(torch.from_numpy(header))
        parts = [a.reshape(-1) for a in arrays] + [np.frombuffer(raw, dtype=np.uint8).astype(np.int64)]
        payload = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if payload.size:
            self._bcast(torch.from_numpy(np.ascontiguousarray(payload)))

    def recv(self) -> Message:
        header_t = torch.zeros(HEADER, dtype=torch.int64)
        self._bcast(header_t)
        header = header_t.numpy()
        kind, n_ints, n_arrays, n_text = (int(v) for v in header[:4])
        shapes = []
        for i in range(n_arrays):
            ndim, d0, d1 = (int(v) for v in header[20 + 3 * i : 23 + 3 * i])
            shapes.append(() if ndim == 0 else (d0,) if ndim == 1 else (d0, d1))
        size = sum(int(np.prod(s)) for s in shapes) + n_text
        payload = np.zeros(0, dtype=np.int64)
        if size:
            t = torch.zeros(size, dtype=torch.int64)
            self._bcast(t)
            payload = t.numpy()
        arrays, at = [], 0
        for s in shapes:
            n = int(np.prod(s))
            arrays.append(payload[at : at + n].reshape(s))
            at += n
        text = payload[at : at + n_text].astype(np.uint8).tobytes().decode()
        return Message(kind, [int(v) for v in header[4 : 4 + n_ints]], text, arrays)
