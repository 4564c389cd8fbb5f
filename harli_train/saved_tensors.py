"""Which tensors autograd saves for backward stay where they are when a saved-tensor hook moves the others
(the page pool's stashes, the step graphs' arena): the model's own weights and buffers, and whatever
belongs to a parameter."""

from __future__ import annotations

import torch


def storages(tensors) -> set[int]:
    """The storage addresses of ``tensors`` (for ``stays_in_place``'s ``exclude``)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def stays_in_place(t: torch.Tensor, exclude: set[int]) -> bool:
    """Whether a saved ``t`` is left where it is: a leaf that requires grad (a trainable parameter, an input
    of the chunk), a tensor whose storage is one of ``exclude`` (frozen weights, static tensors), a
    parameter, or a view of one (a frozen weight's transpose). The cheapest checks come first: this runs
    for every tensor autograd saves."""
    if (t.requires_grad and t.is_leaf) or t.untyped_storage().data_ptr() in exclude:
        return True
    if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    return base is not None and type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter)
