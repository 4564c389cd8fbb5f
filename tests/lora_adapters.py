"""A tiny HF Llama with a byte-level tokenizer and PEFT adapters for it, made by peft itself with random
(non-zero) A and B: the reference side of the LoRA serving tests."""

from pathlib import Path

import peft
import torch
import transformers

from .byte_level_tokenizer import save_byte_level_tokenizer
from .hf_models import save_tiny_llama

VOCAB = 264  # the byte-level tokenizer's 259 ids, padded
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path) -> Path:
    special = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)
    save_tiny_llama(
        path, vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2, std=0.1, **special
    )
    save_byte_level_tokenizer(path)
    return path


def save_peft_adapter(base: Path, out: Path, rank: int, alpha: float, targets: list[str], seed: int) -> Path:
    """An adapter saved by peft (adapter_config.json + adapter_model.safetensors) with random A and B."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    pm.save_pretrained(out)
    assert (out / "adapter_model.safetensors").is_file()
    return out


def peft_merged(base: Path, adapter: Path | None) -> transformers.PreTrainedModel:
    """transformers' base with peft's load of the adapter, merged by peft (the base alone without one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@torch.no_grad()
def greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`, the whole sequence re-run each step (no cache: nothing to get wrong)."""
    seq = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(ids) :]
