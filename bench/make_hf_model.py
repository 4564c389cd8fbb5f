"""Write a small random-weight Llama as a local Hugging Face directory (config.json, safetensors, a byte-level
BPE tokenizer trained on the shipped data), for commands that take a model directory where none can be
downloaded.

    python bench/make_hf_model.py OUT_DIR [--hidden 256] [--layers 4] [--vocab 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def texts() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "recipes/data/quickstart.jsonl").read_text().splitlines()]
    return [r.get("prompt", "") + r.get("completion", "") + r.get("text", "") for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2]
    )
    fast.save_pretrained(args.out)
    heads = max(args.hidden // 64, 1)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    transformers.LlamaForCausalLM(config).save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
