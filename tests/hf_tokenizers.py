"""Hugging Face tokenizer directories made in the tests (nothing can be downloaded): byte-level BPE with or
without a BOS post-processor, and the special tokens and chat templates of Llama-3 and Qwen2.5 (ChatML)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .hf_models import save_tiny_llama

TEXTS = [
    "hello world, the cat sat on the mat.",
    "What is 12 + 34? It is 46.",
    "The quick brown fox jumps over the lazy dog; a dog barks back.",
    "You are a helpful assistant. Answer briefly and kindly.",
    "Tell me a joke about cats. Why did the cat sit on the computer? To keep an eye on the mouse!",
]

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# Qwen2.5-Instruct's chat template without its tools branch (the conversations here call no tools).
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML whose assistant text sits in {% generation %} blocks (as TRL's templates mark it).
CHATML_GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Special tokens, ids in this order from 0, and the roles they play. `bos_template`: the post-processor adds
# BOS to every encoded text (Llama); `model_eos`: config.json's eos; `generation_eos`: generation_config.json's.
KINDS = {
    "llama": dict(specials=["<s>", "</s>", "<pad>"], bos="<s>", eos="</s>", pad="<pad>", bos_template=True),
    # SmolLM2-style: its "bos" is <|im_start|>, which its post-processor never adds.
    "no-bos": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos="<|im_start|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos_template=False,
    ),
    "llama-3": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        bos_template=True,
        template=LLAMA3_TEMPLATE,
        model_eos="<|end_of_text|>",
        generation_eos=["<|end_of_text|>", "<|eot_id|>"],
    ),
    "qwen2.5": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos_template=False,
        template=QWEN25_TEMPLATE,
        model_eos="<|im_end|>",
        generation_eos=["<|im_end|>", "<|endoftext|>"],
    ),
}


def build_bpe_tokenizer_dir(
    path: Path, kind: str, template: str | None = None
) -> transformers.PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer of `kind` (KINDS) trained on TEXTS, saved to `path`; `template` replaces the
    kind's chat template. Returns it as transformers loads it back."""
    spec = KINDS[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    bos = spec["bos"]
    if spec["bos_template"]:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=spec["eos"], pad_token=spec["pad"]
    )
    chat_template = template or spec.get("template")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def build_hf_model_dir(path: Path, kind: str, template: str | None = None, **config) -> tuple:
    """A tiny random Llama over a `kind` tokenizer, saved to `path` with config.json and generation_config.json
    naming the kind's ids; returns (transformers model, tokenizer)."""
    spec = KINDS[kind]
    tok = build_bpe_tokenizer_dir(path, kind, template)
    ids = {name: tok.convert_tokens_to_ids(name) for name in spec["specials"]}
    model_eos = ids[spec.get("model_eos", spec["eos"])]
    settings = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        std=0.15,  # greedy choices clear-cut: fp32 rounding cannot flip them
        bos_token_id=ids[spec["bos"]] if spec["bos"] else None,
        eos_token_id=model_eos,
        pad_token_id=ids[spec["pad"]] if spec["pad"] else None,
    )
    settings.update(config)
    model = save_tiny_llama(path, **settings)
    generation = {"bos_token_id": settings["bos_token_id"], "eos_token_id": model_eos}
    if "generation_eos" in spec:
        generation["eos_token_id"] = [ids[t] for t in spec["generation_eos"]]
    (path / "generation_config.json").write_text(json.dumps(generation))
    model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model, tok
