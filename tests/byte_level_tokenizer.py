"""A byte-level BPE tokenizer with no merges (ids 0-255 are the bytes, then bos, eos and pad), saved as
transformers saves one: the tokenizer side of test model directories that need real tokenizer files."""

from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 256, 257, 258


def save_byte_level_tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    """Write tokenizer.json and tokenizer_config.json to `path`; returns the tokenizer (259 ids)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[2]
    )
    fast.save_pretrained(path)
    return fast


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to `char`."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]
