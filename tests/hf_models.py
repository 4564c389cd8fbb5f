"""Small random transformers Llama models saved as local HF directories: the reference side of many tests."""

from pathlib import Path

import torch
import transformers


def save_tiny_llama(
    path: Path, *, std: float = 0.05, seed: int = 0, **config
) -> transformers.LlamaForCausalLM:
    """A random `LlamaForCausalLM` (eager attention, untied) saved to `path`; `config` overrides the shape.

    Matrices are N(0, std) and norm weights U(0.5, 1.5), so that every parameter matters in a comparison.
    """
    settings = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=120,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    settings.update(config)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model
