"""The trainer state a checkpoint keeps, as plain data and tensors: nothing in it needs pickle to be read.

A state is ``{"step", "tokens_seen", "loader", "recipe", "optimizer", "rng"}``: the optimizer's
``state_dict()`` and ``rng_state()`` as they are in memory, the rest plain values. ``encode`` splits it into
a JSON-able dict (the plain values, the optimizer's parameter groups, Python's and numpy's RNG states as
lists of ints) and named tensors (``optimizer.<param index>.<name>``, ``rng.torch``, ``rng.cuda.<device>``);
``decode`` puts it back exactly, so a resumed run draws the same random numbers as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

FORMAT = "harli-train trainer state"
VERSION = 1
_SPLIT = ("optimizer", "rng")  # the entries that are not plain values


def rng_state() -> dict[str, Any]:
    """Every random generator training draws from: Python's, numpy's, torch's (and each GPU's)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def encode(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(plain, tensors)``: ``plain`` holds only JSON values, ``tensors`` contiguous CPU tensors."""
    tensors: dict[str, torch.Tensor] = {}
    optimizer, rng = state["optimizer"], state["rng"]
    for index, per_param in optimizer["state"].items():
        for name, value in per_param.items():
            tensors[f"optimizer.{index}.{name}"] = value
    tensors["rng.torch"] = rng["torch"]
    cuda = rng.get("cuda", [])
    for device, value in enumerate(cuda):
        tensors[f"rng.cuda.{device}"] = value
    version, internal, gauss_next = rng["python"]
    generator, key, pos, has_gauss, gauss = rng["numpy"]
    plain = {
        "format": FORMAT,
        "version": VERSION,
        **{k: v for k, v in state.items() if k not in _SPLIT},
        "optimizer": {"param_groups": optimizer["param_groups"]},
        "rng": {
            "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
            "numpy": {
                "generator": generator,
                "key": key.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "cuda_devices": len(cuda),
        },
    }
    return plain, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def decode(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state ``encode`` split; ValueError, KeyError or TypeError when ``plain`` is not one it made."""
    if not isinstance(plain, dict) or plain.get("format") != FORMAT:
        raise ValueError(f"no {FORMAT!r} marker")
    if plain["version"] != VERSION:
        raise ValueError(f"format version {plain['version']!r}; this harli-train reads version {VERSION}")
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        kind, _, rest = name.partition(".")
        if kind == "optimizer":
            index, field = rest.split(".")
            per_param.setdefault(int(index), {})[field] = value
    # torch keeps sequence hyper-parameters (AdamW's betas) as tuples; JSON made them lists.
    groups = [
        {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
        for group in plain["optimizer"]["param_groups"]
    ]
    py, npy = plain["rng"]["python"], plain["rng"]["numpy"]
    rng = {
        "python": (py["version"], tuple(py["state"]), py["gauss_next"]),
        "numpy": (
            npy["generator"],
            np.array(npy["key"], dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["gauss"],
        ),
        "torch": tensors["rng.torch"],
    }
    if plain["rng"]["cuda_devices"]:
        rng["cuda"] = [tensors[f"rng.cuda.{d}"] for d in range(plain["rng"]["cuda_devices"])]
    rest = {k: v for k, v in plain.items() if k not in ("format", "version", *_SPLIT)}
    missing = {"step", "tokens_seen", "loader"} - rest.keys()
    if missing:
        raise KeyError(f"no {', '.join(sorted(missing))}")
    return {**rest, "optimizer": {"state": per_param, "param_groups": groups}, "rng": rng}
