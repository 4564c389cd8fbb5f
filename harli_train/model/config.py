"""Model shape: a Llama-family decoder, read from a Hugging Face config.json or a named preset."""

from __future__ import annotations

import functools
import json
from dataclasses import InitVar, asdict, dataclass
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
    where: InitVar[str] = "model config"  # the file (or "model config") that errors name

    def __post_init__(self, where: str) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, name) <= 0:
                raise ModelError(f"{where}: {name} must be positive, got {getattr(self, name)}")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"{where}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"{where}: head_dim must be even for RoPE, got {self.head_dim}")

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
    def from_hf_dict(cls, d: dict[str, Any], where: str = "model config") -> ModelConfig:
        """The shape a transformers `config.json` describes; ModelError naming `where` and the key for a
        missing key or a value of the wrong type."""
        if not isinstance(d, dict):
            raise ModelError(f"{where}: expected a JSON object of model settings, got {_describe(d)}")
        read = functools.partial(_read, d, where)
        model_type = read("model_type", str, "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ModelError(f"{where}: model type {model_type!r} is not supported (llama, qwen2, mistral)")
        rope_parameters = read("rope_parameters", dict, {})
        heads = read("num_attention_heads", int)
        return cls(
            vocab_size=read("vocab_size", int),
            hidden_size=read("hidden_size", int),
            intermediate_size=read("intermediate_size", int),
            num_layers=read("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=read("num_key_value_heads", int, heads),
            head_dim=read("head_dim", int, 0),
            rms_norm_eps=read("rms_norm_eps", float, 1e-5),
            rope_theta=read("rope_theta", float, _read(rope_parameters, where, "rope_theta", float, 10000.0)),
            rope_scaling=_rope_scaling(d, where),
            max_position_embeddings=read("max_position_embeddings", int, 8192),
            tie_word_embeddings=read("tie_word_embeddings", bool, False),
            attention_bias=read("attention_bias", bool, model_type == "qwen2"),
            bos_token_id=read("bos_token_id", int, None),
            eos_token_id=_eos_ids(d, where),
            pad_token_id=read("pad_token_id", int, None),
            model_type=model_type,
            where=where,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """The model of a Hugging Face directory: config.json, with the EOS ids of generation_config.json
        (when there is one) added to its own: a chat model stops on its end-of-turn token (`<|eot_id|>`,
        `<|im_end|>`), which often only the generation config names, as transformers' `generate` does."""
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ModelError(
                f"model directory {path}: no config.json found (expected a Hugging Face model folder)"
            )
        config = cls.from_hf_dict(_read_json(cfg), str(cfg))
        generation = Path(path) / "generation_config.json"
        if generation.is_file():
            extra = _as_list(_eos_ids(_read_json(generation), str(generation)))
            ids = list(dict.fromkeys(_as_list(config.eos_token_id) + extra))
            config.eos_token_id = ids[0] if len(ids) == 1 else ids or None
        return config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _describe(value: Any) -> str:
    """A JSON value as an error shows it: its kind, and the value itself when it is short."""
    kinds = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number"}
    text = json.dumps(value, default=repr)
    return f"a JSON {kinds.get(type(value), 'null')}" + (f" {text}" if len(text) <= 40 else "")


_NOUNS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
_REQUIRED = object()


def _read(d: dict[str, Any], where: str, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """`d[key]` checked to be of `kind` (an integer is a number, a boolean is no integer); `default` when it
    is null or absent (absent with no default: an error). ModelError names `where` and the key."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelError(f"{where}: {key}: missing (a Llama-family config.json has it)")
        return default
    if not _is(value, kind):
        raise ModelError(f"{where}: {key}: expected {_NOUNS[kind]}, got {_describe(value)}")
    return float(value) if kind is float else value


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not a JSON file ({type(e).__name__}: {e})") from None


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _eos_ids(d: dict[str, Any], where: str) -> int | list[int] | None:
    if not isinstance(d, dict):
        raise ModelError(f"{where}: expected a JSON object of model settings, got {_describe(d)}")
    eos = d.get("eos_token_id")
    if eos is None or _is(eos, int) or (isinstance(eos, list) and all(_is(t, int) for t in eos)):
        return eos
    raise ModelError(
        f"{where}: eos_token_id: expected an integer or a list of integers, got {_describe(eos)}"
    )


def _rope_scaling(d: dict[str, Any], where: str) -> dict[str, Any] | None:
    # transformers 5 moved rope settings into `rope_parameters`; 4.x keeps `rope_scaling`.
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rs = _read(d, where, key, dict, None)
    if not rs:
        return None
    read = functools.partial(_read, rs, f"{where}: {key}")
    kind = read("rope_type", str, None) or read("type", str, "default")
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelError(f"{where}: rope scaling {kind!r} is not supported (only Llama-3 style 'llama3')")
    out = {k: read(k, float) for k in ("factor", "low_freq_factor", "high_freq_factor")}
    return {**out, "original_max_position_embeddings": read("original_max_position_embeddings", int)}


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
    # Llama-3-70B shapes, for the tensor-parallel bench (140 GB in bf16: split over 2-8 GPUs).
    "llama-70b": ModelConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
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
