"""CUDA settings the co-located process needs before its CUDA context exists (read once, at context creation).

``CUDA_DEVICE_MAX_CONNECTIONS=32``: the number of hardware work queues the context maps its streams onto
(default 8). The ladder alone has two streams per rung, so with 8 queues decode's streams share a queue with a
trainer stream. On the H200, the trainer's kernel launches on a small rung filled its queue and blocked
(``cuLaunchKernelEx`` in Triton's launcher), and decode's own submissions on the shared queue blocked with them:
a stack sampler caught the decode loop in ``Event.record`` and in the engine's step for 25-36 ms while the
trainer's autograd thread sat in a launch, the GIL free all along
(``bench/results/2026-11-29-bench_colocate-s6-stall-samples.json.gz``, ``bench/stall_sampler.py``).

A value the user set is left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SETTINGS = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def prefer_cuda_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of ``SETTINGS`` the environment lacks; returns the ones set. Call before the first CUDA call
    (torch creates its context lazily, so importing torch first is fine)."""
    env = os.environ if env is None else env
    applied = {k: v for k, v in SETTINGS.items() if k not in env}
    env.update(applied)
    return applied
