"""One copy of the base weights for the trainer and the decode engine.

The trainer's model carries the LoRA adapter; the engine must serve the *base* model. ``base_view`` builds
a second module tree whose frozen parameters and buffers are the very tensors of the trainer's model (no
copy) and whose projection layers carry no adapter, so decode never applies the adapter being trained
and the engine's "no adapter attached" check holds without touching the model code.
"""

from __future__ import annotations

from torch import nn

from harli_train.model import LlamaForCausalLM

_LORA_NAMES = ("lora_A", "lora_B")


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    path, _, leaf = dotted.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def base_view(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A LoRA-free model sharing every frozen weight and buffer tensor of ``model``; in eval mode."""
    view = model.empty_like()  # a tensor-parallel slice keeps its class (and its collectives)
    for name, param in model.named_parameters(remove_duplicate=False):
        module, leaf = _owner(view, name)
        if leaf in _LORA_NAMES:
            continue
        module._parameters[leaf] = param  # the same Parameter object: tied weights stay tied
    for name, buf in model.named_buffers(remove_duplicate=False):
        module, leaf = _owner(view, name)
        module._buffers[leaf] = buf
    left = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"base_view: tensors not shared from the trainer's model: {left[:5]}")
    return view.eval()


def shares_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether every frozen weight of ``b`` is stored in the same memory as ``a``'s (no copy)."""
    ptrs = {p.data_ptr() for p in a.parameters()}
    return all(
        p.data_ptr() in ptrs for n, p in b.named_parameters() if n.rsplit(".", 1)[-1] not in _LORA_NAMES
    )
