"""Tokenizers behind one small interface: bytes for random-weight presets, Hugging Face for real models.

Which special tokens a text gets is each tokenizer's own rule (`encode(text, add_special_tokens=True)`):
the byte tokenizer puts its BOS first, a Hugging Face tokenizer does what its post-processor says (a
Llama tokenizer adds `<s>` or `<|begin_of_text|>`, a ChatML one adds nothing). `harli_train.data.tokenization`
is the one place that decides when to ask for them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from harli_train.data.example import DataError

# Any one of these marks a directory as holding a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# A chat template that marks its assistant text with {% generation %} ... {% endgeneration %}.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Tokenizer(Protocol):
    """What the data pipeline and the engine need from a tokenizer. `source` names it in errors (the model
    directory, or the preset); `chat_template` is None when it has none."""

    source: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer with a chat template: renders conversations and locates text in its tokens."""

    has_generation_tags: bool

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def assistant_tokens_mask(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus bos=256, eos=257, pad=258 (the `tiny` preset's special ids). Its rule
    for special tokens: BOS first, nothing after. It has no chat template."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    chat_template = None

    def __init__(self, source: str = "the byte-level tokenizer of a preset"):
        self.source = source

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's UTF-8 bytes, after BOS when `add_special_tokens`."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        """Drops special ids; invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers` tokenizer read from a local directory, behind the same interface as ByteTokenizer."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.source = str(self.path)
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
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: transformers renders with "default"
            template = template.get("default")
        self.chat_template: str | None = template if isinstance(template, str) and template else None
        self.has_generation_tags = bool(self.chat_template and _GENERATION_TAG.search(self.chat_template))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, with the special tokens its post-processor adds when `add_special_tokens`."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as its chat template writes it (special tokens as text); DataError with the
        template's own complaint (e.g. roles that do not alternate)."""
        return self._chat(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a rendered text (no special tokens added: the template wrote them) and the character
        span [start, end) of each token in `text`."""
        try:
            enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # only fast (Rust) tokenizers know where their tokens came from
            raise DataError(
                f"{self.path}: the tokenizer cannot map its tokens back to the text (it is not a fast "
                "tokenizer), which locating the assistant's turns needs; use data.train_on: all"
            ) from None
        return list(enc["input_ids"]), [tuple(span) for span in enc["offset_mapping"]]

    def assistant_tokens_mask(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(ids, mask) of the rendered conversation, mask 1 on the tokens the template's {% generation %}
        blocks wrote (transformers' `return_assistant_tokens_mask`)."""
        out = self._chat(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
        )
        return list(out["input_ids"]), list(out["assistant_masks"])

    def _chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        if self.chat_template is None:
            raise DataError(f"{self.path}: the tokenizer has no chat template")
        try:
            return self._tok.apply_chat_template(messages, **kwargs)
        except Exception as e:  # jinja's TemplateError, or raise_exception() inside the template
            raise DataError(f"the chat template of {self.path} refused the conversation: {e}") from None


def _first_id(token_id: int | list[int] | None) -> int | None:
    if isinstance(token_id, (list, tuple)):
        return token_id[0] if token_id else None
    return token_id


def load_tokenizer(source: str, is_preset: bool) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model source: bytes for a preset, else the tokenizer files in dir `source`."""
    if is_preset:
        return ByteTokenizer(f"preset {source!r} (a byte-level tokenizer)")
    path = Path(source)
    if not path.is_dir():
        raise DataError(f"{path}: tokenizer directory not found")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"{path}: no tokenizer found; looked for {', '.join(TOKENIZER_FILES)}")
    return HFTokenizer(path)
