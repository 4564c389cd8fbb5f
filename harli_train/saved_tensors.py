"""Which tensors autograd saves for backward stay where they are when a saved-tensor hook moves the others
(the page pool's stashes, the step graphs' arena): the model's own weights and buffers, and whatever
belongs to a parameter."""

from __future__ import annotations

import torch


def storages(tensors) -> set[int]:
    """The storage addresses of ``tensors`` (for ``stays_in_place``'s ``exclude``)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def stays_in_place(t: torch.Tensor, exclude: set[int]) -> bool:
    """Whether a saved ``t`` is left where it is: a leaf that requires grad and is no view (a trainable
    parameter, an input of the chunk), a tensor whose storage is one of ``exclude`` (frozen weights, static
    tensors), a parameter, or a view of one (a frozen weight's transpose). A view made inside a custom
    Function's forward (grad mode off) of an activation that requires grad also reads as a leaf that requires
    grad: its ``_base`` tells it apart, and it is moved like the activation it views. The cheapest checks come
    first: this runs for every tensor autograd saves."""
    if (t.requires_grad and t.is_leaf and t._base is None) or t.untyped_storage().data_ptr() in exclude:
        return True
    if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    return base is not None and type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter)
