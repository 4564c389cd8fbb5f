"""Capturing an engine step's CUDA graphs: one per (batch bucket, variant) on a partition's stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from harli_train.cuda_capture import capturing


def capture_buckets(
    graphs: dict[tuple[str, int, bool], Any],
    key: str,
    buckets: Sequence[int],
    variants: Sequence[bool],
    forward: Callable[[int, bool], None],
    stream: torch.cuda.Stream,
    pool: Any = None,
) -> Any:
    """Capture ``forward(bucket, variant)`` into ``graphs[(key, bucket, variant)]`` for every bucket (largest
    first, so the smaller graphs reuse its memory) and variant, all in one memory pool; returns the pool
    (``pool``, or a new one when None). The caller has set the static inputs so that the runs write
    nothing (K/V slots -1, empty adapter slots).

    Each capture follows one eager run on ``stream`` (it compiles the kernels and sets up cuBLAS outside the
    capture), and each graph is replayed once: its first launch uploads it to the device, which no served
    step should pay for.
    """
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    for bucket in sorted(buckets, reverse=True):
        for variant in variants:
            with torch.cuda.stream(stream):
                forward(bucket, variant)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # what torch.cuda.graph does before a capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), capturing(graph, pool, error_mode="global"):
                forward(bucket, variant)
            with torch.cuda.stream(stream):
                graph.replay()
            graphs[(key, bucket, variant)] = graph
    torch.cuda.synchronize()
    return pool


# torch's index_select launches one kernel up to this many indices and another (a gather) past them.
GATHER_SMALL_INDICES = 16


def load_gather_kernels(device: torch.device, max_rows: int) -> None:
    """Launch, on the current stream, the gather that a step launched ahead stages its fed tokens with
    (``torch.index_select`` of int64 ids) at one row and, when ``max_rows`` passes
    ``GATHER_SMALL_INDICES``, at ``max_rows``: torch picks its kernel by the count of indices, and CUDA loads
    a kernel into a context on its first launch there (lazy module loading), which waits for the device's
    queued work (docs/design.md, "Measured facts behind the defaults"). Called once per partition's stream
    after its graphs are captured (``ModelRunner.add_partition``; a green context loads its own)."""
    sizes = {1, max_rows} if max_rows > GATHER_SMALL_INDICES else {1}
    src = torch.zeros(max(sizes), dtype=torch.int64, device=device)
    out = torch.empty_like(src)
    for n in sorted(sizes):
        index = torch.zeros(n, dtype=torch.int64, device=device)
        torch.index_select(src, 0, index, out=out[:n])
