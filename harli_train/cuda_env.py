"""CUDA settings the co-located process needs before its CUDA context exists (read once, at context creation).

``CUDA_DEVICE_MAX_CONNECTIONS=32``: the number of hardware work queues the context maps its streams onto
(default 8). The ladder alone has two streams per rung, so with 8 queues decode's streams share a queue with a
trainer stream, and a trainer launch that finds its queue full blocks decode's submissions on it as well
(docs/design.md, "Measured facts behind the defaults").

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
