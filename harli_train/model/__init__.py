"""The Llama-family model shared by the trainer and the decode engine."""

from harli_train.model.config import PRESETS, ModelConfig, ModelError
from harli_train.model.linear import LoRALinear
from harli_train.model.llama import LORA_TARGETS, LlamaForCausalLM
from harli_train.model.loader import is_preset, load_model, model_config, resolve_dtype

__all__ = [
    "PRESETS",
    "LORA_TARGETS",
    "LlamaForCausalLM",
    "LoRALinear",
    "ModelConfig",
    "ModelError",
    "is_preset",
    "load_model",
    "model_config",
    "resolve_dtype",
]
