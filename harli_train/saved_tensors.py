"""Which tensors autograd saves for backward stay where they are when a saved-tensor hook moves the others
(the page pool's stashes, the step graphs' arena): the model's own weights and buffers, and whatever
belongs to a parameter."""

from __future__ import annotations

import torch


def storages(tensors) -> set[int]:
    """The storage addresses of ``tensors`` (for ``stays_in_place``'s ``exclude``)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def stays_in_place(t: torch.Tensor, exclude: set[int]) -> bool:
    """Whether a saved ``t`` is left where it is: a tensor whose storage is one of ``exclude`` (frozen
    weights, static tensors); a leaf that requires grad (a trainable parameter, an input of the chunk) or a
    view of one; a parameter or a view of one (a frozen weight's transpose). A view is judged by its base:
    inside a custom Function's forward (grad mode off) a view of an activation also reads as a leaf that
    requires grad, and it is moved like the activation it views. The cheapest checks come first: this runs for
    every tensor autograd saves."""
    if t.untyped_storage().data_ptr() in exclude:
        return True
    base = t._base
    root = t if base is None else base
    if root.requires_grad and root.is_leaf:
        return True
    # The exact-type test first: Parameter's isinstance goes through a Python metaclass check.
    return type(root) is not torch.Tensor and isinstance(root, torch.nn.Parameter)
