"""Tokenizers behind one small interface: bytes for random-weight presets, Hugging Face for real models."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from harli_train.data.dataset import DataError

# Any one of these marks a directory as holding a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus bos=256, eos=257, pad=258 (the `tiny` preset's special ids)."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """The text's UTF-8 bytes; no special tokens are added."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Drops special ids; invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers` tokenizer read from a local directory, behind the same interface as ByteTokenizer."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:  # whatever transformers raises, the user's directory is at fault
            raise DataError(f"{self.path}: could not load the tokenizer: {e}") from e
        self.bos_id: int | None = _first_id(self._tok.bos_token_id)
        eos_id = _first_id(self._tok.eos_token_id)
        if eos_id is None:
            raise DataError(f"{self.path}: the tokenizer defines no eos token; examples need one to end on")
        self.eos_id: int = eos_id
        pad_id = _first_id(self._tok.pad_token_id)
        self.pad_id: int = eos_id if pad_id is None else pad_id
        # len() counts added tokens, which `vocab_size` leaves out.
        self.vocab_size: int = len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the tokenizer's chat template, ready for the assistant's turn."""
        ids = self._tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return [int(t) for t in ids]


def _first_id(token_id: int | list[int] | None) -> int | None:
    if isinstance(token_id, (list, tuple)):
        return token_id[0] if token_id else None
    return token_id


def load_tokenizer(source: str, is_preset: bool) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model source: bytes for a preset, else the tokenizer files in dir `source`."""
    if is_preset:
        return ByteTokenizer()
    path = Path(source)
    if not path.is_dir():
        raise DataError(f"{path}: tokenizer directory not found")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"{path}: no tokenizer found; looked for {', '.join(TOKENIZER_FILES)}")
    return HFTokenizer(path)
