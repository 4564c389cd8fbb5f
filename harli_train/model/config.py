"""Model shape: a Llama-family decoder, read from a Hugging Face config.json or a named preset."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A model source that cannot be used: the message says what was looked for."""


@dataclass(slots=True)
class ModelConfig:
    """Shapes and numerics of a Llama-style model (Qwen2 = Llama + qkv bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ModelError(f"model type {model_type!r} is not supported (llama, qwen2, mistral)")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(d),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", model_type == "qwen2"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            model_type=model_type,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ModelError(
                f"model directory {path}: no config.json found (expected a Hugging Face model folder)"
            )
        try:
            return cls.from_hf_dict(json.loads(cfg.read_text()))
        except (KeyError, json.JSONDecodeError) as e:
            raise ModelError(f"{cfg}: not a usable Llama config ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    # transformers 5 moved rope settings into `rope_parameters`; 4.x keeps `rope_scaling`.
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelError(f"rope scaling {kind!r} is not supported (only Llama-3 style 'llama3')")
    return {
        k: rs[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    }


_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    # Llama-3-8B shapes.
    "llama-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # Llama-3.2-1B shapes (tied embeddings).
    "llama-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # Qwen2.5-7B shapes: qkv bias, untied head.
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        model_type="qwen2",
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Test-sized model over the byte-level tokenizer (259 ids, padded to 320).
    "tiny": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
}
