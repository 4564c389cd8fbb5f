"""TextReader against its reference, decoding the whole completion at every token: the same text handed out
(streamed in pieces, whole at the end), the same cut at stop strings, and a window that does not grow with the
completion."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harli_train.data.tokenizer import load_tokenizer
from harli_train.serve.text_reader import TextReader

from .hf_tokenizers import TEXTS, build_bpe_tokenizer_dir

SAMPLES = [
    *TEXTS,
    "Grüße aus Köln ✓ 漢字 — ünïcode, then ASCII again.",
    "  two  spaces\nand a newline\tand a tab",
]


class Counting:
    """A tokenizer whose decode calls and the ids they read are counted."""

    def __init__(self, tokenizer):
        self.inner, self.calls, self.ids_read = tokenizer, 0, 0

    def decode(self, ids):
        self.calls, self.ids_read = self.calls + 1, self.ids_read + len(ids)
        return self.inner.decode(ids)


def reference(tokenizer, ids: list[int], stop: list[str]) -> str:
    full = tokenizer.decode(ids)
    cuts = [at for at in (full.find(s) for s in stop) if at >= 0]
    return full[: min(cuts)] if cuts else full


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (a leading space as U+2581, dropped at the start of a decode)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = sorted({c for t in SAMPLES for c in t} | {"\u2581"})
    tok.train_from_iterator(SAMPLES * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                               initial_alphabet=alphabet))  # fmt: skip
    return tok


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    bpe = build_bpe_tokenizer_dir(tmp_path_factory.mktemp("bpe"), "llama")
    return {"byte": load_tokenizer("tiny", True), "byte-level BPE": bpe, "metaspace": metaspace_tokenizer()}


def ids_of(tokenizer, text: str) -> list[int]:
    out = tokenizer.encode(text)
    ids = out.ids if hasattr(out, "ids") else out
    bos = getattr(tokenizer, "bos_token_id", None)
    return [i for i in ids if i != bos]


@pytest.mark.parametrize("name", ["byte", "byte-level BPE", "metaspace"])
@pytest.mark.parametrize("stop", [[], ["cat"], ["\n", "fox jumps"], ["ü"]])
def test_the_text_handed_out_is_the_whole_decode_cut_at_the_first_stop(tokenizers_, name, stop):
    tokenizer, rng = tokenizers_[name], random.Random(0)
    for text in SAMPLES:
        ids = ids_of(tokenizer, text)
        for _ in range(3):  # steps of 1-3 tokens, as an engine step draws them
            reader, pieces, i = TextReader(tokenizer, stop), [], 0
            while i < len(ids) and not reader.stopped:
                n = rng.randint(1, 3)
                pieces.append(reader.feed(ids[i : i + n]))
                i += n
            streamed = "".join(pieces)
            pieces.append(reader.finish())
            want = reference(tokenizer, ids, stop)
            assert "".join(pieces) == want == reader.text, (name, text, stop)
            assert want.startswith(streamed) and "\ufffd" not in streamed
            if stop and reader.stopped:
                assert not any(s in reader.text for s in stop)


def test_each_token_decodes_a_window_not_the_whole_completion(tokenizers_):
    tokenizer = Counting(tokenizers_["byte-level BPE"])
    ids = ids_of(tokenizer.inner, " ".join(TEXTS * 6))
    assert len(ids) > 300
    reader = TextReader(tokenizer, [])
    for token in ids:
        reader.feed([token])
    per_token = tokenizer.ids_read / len(ids)
    assert per_token < 8, per_token  # the whole each time would read len(ids) / 2 on average
    reader.finish()
    assert reader.text == tokenizer.inner.decode(ids)


def test_a_multibyte_character_split_over_tokens_waits_for_its_last_byte(tokenizers_):
    tokenizer = tokenizers_["byte"]
    ids = ids_of(tokenizer, "a✓b")  # ✓ is three bytes
    reader = TextReader(tokenizer, [])
    assert reader.feed(ids[:1]) == "a"
    assert reader.feed(ids[1:2]) == "" and reader.feed(ids[2:3]) == ""
    assert reader.feed(ids[3:4]) == "✓" and reader.feed(ids[4:]) == "b"
    assert reader.finish() == "" and reader.text == "a✓b"
