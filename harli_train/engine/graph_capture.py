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
