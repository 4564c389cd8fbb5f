"""Least squares for the latency models: weighted, with columns scaled to unit range."""

from __future__ import annotations

import numpy as np


def weighted_lstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Coefficients minimising ``|w * (X @ c - y)|``; columns are scaled first (KV bytes reach 1e10)."""
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq((X / scale) * w[:, None], y * w, rcond=None)
    return coef / scale
