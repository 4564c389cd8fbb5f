"""Data pipeline: tokenizers, JSONL examples and their loss masks, the batch loader and its resume."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    DataError,
    DataLoader,
    Example,
    HFTokenizer,
    load_examples,
    load_tokenizer,
)

RECIPE_DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
QUICKSTART = RECIPE_DATA.parent / "quickstart.yaml"
BOS, EOS, PAD = 256, 257, 258


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def numbered_examples(lengths: list[int]) -> list[Example]:
    """Example i is `lengths[i]` copies of token 1000 + i; labels are ids + 1 so their alignment shows."""
    return [Example([1000 + i] * n, [1001 + i] * n) for i, n in enumerate(lengths)]


def drain(loader: DataLoader, n: int) -> list[dict]:
    return [loader.next_batch() for _ in range(n)]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["labels"], y["labels"])
        assert x["num_target_tokens"] == y["num_target_tokens"]


# ---- tokenizers ----


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café, Ελληνικά, 日本語 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut multi-byte character is replaced
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (BOS, EOS, PAD, 259)


def build_hf_tokenizer_dir(path: Path, with_pad: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"] + (["<pad>"] if with_pad else [])
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["hello world", "the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=specials)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if with_pad else None,
    )
    fast.save_pretrained(path)
    return path


def test_hf_tokenizer_from_local_dir(tmp_path):
    tok = load_tokenizer(str(build_hf_tokenizer_dir(tmp_path)), is_preset=False)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("the cat sat")
    assert len(ids) == 3 and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "the cat sat"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.vocab_size == 4 + len({"hello", "world", "the", "cat", "sat", "on", "mat"})


def test_hf_tokenizer_pad_falls_back_to_eos(tmp_path):
    tok = HFTokenizer(build_hf_tokenizer_dir(tmp_path, with_pad=False))
    assert tok.pad_id == tok.eos_id == 2


def test_load_tokenizer_preset_and_errors(tmp_path):
    assert isinstance(load_tokenizer("tiny", is_preset=True), ByteTokenizer)
    with pytest.raises(DataError, match="tokenizer.json.*tokenizer.model") as e:
        load_tokenizer(str(tmp_path), is_preset=False)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(str(tmp_path / "absent"), is_preset=False)


# ---- examples ----


def test_prompt_completion_masks_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "cd", "id": 7}])
    (ex,) = load_examples(path, "auto", ByteTokenizer())
    a, b, c, d = b"abcd"
    assert ex.input_ids == [BOS, a, b, c, d, EOS]
    assert ex.labels == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, c, d, EOS]


def test_text_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hé"}, "", {"text": "x"}])
    examples = load_examples(path, "text", ByteTokenizer())
    h, e1, e2 = "hé".encode()
    assert examples[0].input_ids == [BOS, h, e1, e2, EOS]
    assert examples[0].labels == [IGNORE_INDEX, h, e1, e2, EOS]
    assert examples[1].input_ids == [BOS, ord("x"), EOS]


def test_max_examples(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": str(i)} for i in range(10)] + ["not json"])
    assert len(load_examples(path, "auto", ByteTokenizer(), max_examples=4)) == 4


@pytest.mark.parametrize(
    "rows, fmt, line, message",
    [
        (['{"prompt": "a", "completion": "b"}', '{"prompt": "a", '], "auto", 2, "invalid JSON"),
        ([{"text": "a"}, "[1, 2]"], "auto", 2, "expected a JSON object"),
        ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], "auto", 2, "missing field 'completion'"),
        ([{"text": "a"}, {"text": 3}], "auto", 2, "field 'text' must be a string, got int"),
        ([{"prompt": "a", "completion": "b"}, "", {"text": "c"}], "auto", 3, "a file must use one format"),
        ([{"text": "a"}], "prompt_completion", 1, "row is in text format"),
        (
            [{"question": "a"}],
            "auto",
            1,
            "none of the fields of a known format .*'messages'.*; keys: question",
        ),
        ([{"text": "a", "prompt": "b"}], "auto", 1, "both"),
        (
            [{"text": ""}, {"text": ""}],
            "auto",
            None,
            "no usable rows: rows at .*bad.jsonl:1, .*bad.jsonl:2 have no text",
        ),
        (["", "  "], "auto", None, "no usable rows"),
    ],
)
def test_errors_name_file_and_line(tmp_path, rows, fmt, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message) as e:
        load_examples(path, fmt, ByteTokenizer())
    assert str(e.value).startswith(f"{path}:{line}:" if line else f"{path}:")


def test_errors_missing_empty_and_non_utf8_file(tmp_path):
    with pytest.raises(DataError, match="not found") as e:
        load_examples(tmp_path / "absent.jsonl", "auto", ByteTokenizer())
    assert "absent.jsonl" in str(e.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: data file is empty"):
        load_examples(tmp_path / "empty.jsonl", "auto", ByteTokenizer())
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8"):
        load_examples(tmp_path / "latin1.jsonl", "auto", ByteTokenizer())
    with pytest.raises(DataError, match="unknown data format 'csv'"):
        load_examples(tmp_path / "latin1.jsonl", "csv", ByteTokenizer())


def test_a_data_folder_reads_its_data_files_and_says_when_it_holds_none(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "notes.txt").write_text("not data\n")
    (folder / "sub.jsonl").mkdir()  # a folder named like a data file is not one
    with pytest.raises(DataError) as e:
        load_examples(folder, "auto", ByteTokenizer())
    assert str(e.value) == (
        f"{folder}: a directory holding no data files (.jsonl, .json, .parquet, .csv); data.path is a data "
        "file or a folder of them"
    )
    result = CliRunner().invoke(
        main, [str(QUICKSTART), f"data.path={folder}", f"output.dir={tmp_path / 'r'}"]
    )
    assert result.exit_code == 2 and f"Error: {e.value}" in result.output and "Traceback" not in result.output
    write_jsonl(folder / "b.jsonl", [{"text": "bb"}])
    write_jsonl(folder / "a.jsonl", [{"text": "a"}, {"text": ""}])
    examples = load_examples(folder, "auto", ByteTokenizer())  # name order: a.jsonl, then b.jsonl
    assert [e.input_ids[1:-1] for e in examples] == [[ord("a")], [ord("b"), ord("b")]]
    write_jsonl(folder / "c.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(
        DataError, match=r"c.jsonl:1: row is in prompt_completion format, but a.jsonl's format"
    ):
        load_examples(folder, "auto", ByteTokenizer())


def test_an_explicit_format_reads_its_fields_and_ignores_the_others(tmp_path):
    # tatsu-lab/alpaca rows carry a rendered "text" beside instruction/input/output.
    rows = [{"text": "ignored", "prompt": "a", "completion": "b"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d.jsonl:1: row has fields of both prompt_completion .* and text"):
        load_examples(path, "auto", ByteTokenizer())
    (ex,) = load_examples(path, "prompt_completion", ByteTokenizer())
    assert ex.input_ids == [BOS, *b"ab", EOS]


def test_train_on_all_learns_the_prompt_too(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "c"}])
    (ex,) = load_examples(path, "auto", ByteTokenizer(), train_on="all")
    assert ex.labels == ex.input_ids == [BOS, *b"abc", EOS]


def test_a_seeded_validation_split(tmp_path):
    from harli_train.data.dataset import split_examples

    examples = numbered_examples(list(range(1, 41)))
    train, val = split_examples(examples, 0.1, seed=3)
    assert (
        len(val) == 4 and len(train) == 36 and sorted(train + val, key=lambda e: len(e.input_ids)) == examples
    )
    assert [len(e.input_ids) for e in train] == sorted(len(e.input_ids) for e in train)  # order kept
    assert split_examples(examples, 0.1, seed=3) == (train, val)
    assert split_examples(examples, 0.1, seed=4)[1] != val
    assert len(split_examples(examples[:3], 0.01, seed=0)[1]) == 1  # at least one held out
    with pytest.raises(DataError, match="cannot hold out a validation fraction of 1 example"):
        split_examples(examples[:1], 0.5, seed=0)


# ---- loader: packing ----


def epoch_stream(loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = drain(loader, loader.batches_per_epoch)
    return torch.cat([b["input_ids"] for b in batches]).flatten(), torch.cat(
        [b["labels"] for b in batches]
    ).flatten()


def assert_labels_aligned(ids: torch.Tensor, labels: torch.Tensor) -> None:
    """Labels are ids + 1 (numbered_examples), but IGNORE_INDEX on each document's first token."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    assert torch.equal(labels, torch.where(starts, IGNORE_INDEX, ids + 1))


def example_order(ids: torch.Tensor, lengths: list[int]) -> list[int]:
    """The example indices a packed stream is made of, checking each appears whole, once and aligned."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    order = [int(v) - 1000 for v in values]
    assert len(set(order)) == len(order)
    assert all(
        int(c) == lengths[i] for i, c in zip(order[:-1], counts[:-1], strict=True)
    )  # the last one may be cut
    assert int(counts[-1]) <= lengths[order[-1]]
    return order


def test_packing_rows_are_examples_in_order():
    lengths = [5, 9, 3, 12, 7, 4, 8, 6, 10, 2, 11]  # 77 tokens: 4 batches of 2 x 9, 5 tokens dropped
    loader = DataLoader(numbered_examples(lengths), batch_size=2, seq_len=9, pad_id=PAD, shuffle=False)
    assert loader.batches_per_epoch == 4
    batch = loader.next_batch()
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 9)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    loader = DataLoader(numbered_examples(lengths), batch_size=2, seq_len=9, pad_id=PAD, shuffle=False)
    ids, labels = epoch_stream(loader)
    expected = torch.tensor([1000 + i for i, n in enumerate(lengths) for _ in range(n)])
    assert torch.equal(ids, expected[:72])
    assert_labels_aligned(ids, labels)


def test_packing_shuffles_by_seed_and_epoch():
    lengths = [3 + (7 * i) % 11 for i in range(40)]

    def orders(seed: int, epochs: int = 2) -> list[list[int]]:
        loader = DataLoader(numbered_examples(lengths), batch_size=3, seq_len=16, pad_id=PAD, seed=seed)
        out = []
        for _ in range(epochs):
            ids, labels = epoch_stream(loader)
            assert_labels_aligned(ids, labels)
            out.append(example_order(ids, lengths))
        return out

    seed0 = orders(0)
    assert seed0 == orders(0)
    assert seed0[0] != seed0[1]  # a fresh order each epoch
    assert seed0[0] != orders(1)[0]
    assert seed0[0] != sorted(seed0[0])
    missing = set(range(len(lengths))) - set(seed0[0])
    assert sum(lengths[i] for i in missing) < 3 * 16  # only the tail that fills no batch is dropped


def test_num_target_tokens_counts_shifted_labels(tmp_path):
    rows = [{"prompt": "p" * (i % 5 + 1), "completion": "c" * (i % 3 + 1)} for i in range(30)]
    examples = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), "auto", ByteTokenizer())
    for packing in (True, False):
        loader = DataLoader(examples, batch_size=4, seq_len=7, pad_id=PAD, packing=packing)
        for batch in drain(loader, 10):
            labels = batch["labels"]
            expected = sum(int(labels[r, t] != IGNORE_INDEX) for r in range(4) for t in range(1, 7))
            assert batch["num_target_tokens"] == expected


# ---- loader: padding ----


def test_padding_mode_pads_truncates_and_masks():
    examples = [Example([1, 2, 3], [-100, 2, 3]), Example(list(range(10, 20)), list(range(10, 20)))]
    loader = DataLoader(examples, batch_size=2, seq_len=6, pad_id=PAD, packing=False, shuffle=False)
    assert loader.batches_per_epoch == 1 and loader.num_truncated == 1
    batch = loader.next_batch()
    assert batch["input_ids"].tolist() == [[1, 2, 3, PAD, PAD, PAD], list(range(10, 16))]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, -100], list(range(10, 16))]
    assert batch["num_target_tokens"] == 2 + 5


# ---- loader: epochs and resume ----


@pytest.mark.parametrize("packing", [True, False])
def test_resume_yields_identical_batches(packing):
    lengths = [4 + (5 * i) % 9 for i in range(23)]
    make = lambda: DataLoader(
        numbered_examples(lengths), batch_size=2, seq_len=8, pad_id=PAD, packing=packing, seed=3
    )
    reference = make()
    bpe = reference.batches_per_epoch
    uninterrupted = drain(reference, 3 * bpe + 1)
    # Mid-epoch, exactly on an epoch boundary, and where the continuation crosses one.
    for stop in (bpe // 2, bpe, 2 * bpe - 1):
        first = make()
        drain(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # it must survive plain serialization
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.epoch == pytest.approx(stop / bpe)
        assert_same_batches(drain(resumed, bpe + 1), uninterrupted[stop : stop + bpe + 1])


def test_epoch_progress():
    loader = DataLoader(numbered_examples([8] * 8), batch_size=2, seq_len=8, pad_id=PAD)
    assert loader.batches_per_epoch == 4 and loader.epoch == 0.0
    drain(loader, 5)
    assert loader.epoch == pytest.approx(1.25)


def test_resume_with_changed_settings_is_refused():
    examples = numbered_examples([8] * 8)
    state = DataLoader(examples, batch_size=2, seq_len=8, pad_id=PAD).state_dict()
    with pytest.raises(DataError, match="batch_size was 2, now 4"):
        DataLoader(examples, batch_size=4, seq_len=8, pad_id=PAD).load_state_dict(state)
    with pytest.raises(DataError, match="num_examples was 8, now 7"):
        DataLoader(examples[:7], batch_size=2, seq_len=8, pad_id=PAD).load_state_dict(state)


def test_not_enough_data():
    examples = numbered_examples([5, 6, 7])
    with pytest.raises(DataError, match=r"4 x 8 = 32 tokens, but the 3 examples have 18"):
        DataLoader(examples, batch_size=4, seq_len=8, pad_id=PAD)
    with pytest.raises(DataError, match="batch_size is 4, but there are only 3 examples"):
        DataLoader(examples, batch_size=4, seq_len=8, pad_id=PAD, packing=False)


# ---- recipe data ----


def test_recipe_data_loads_and_quickstart_is_reproducible(tmp_path):
    tok = ByteTokenizer()
    examples = load_examples(RECIPE_DATA / "quickstart.jsonl", "auto", tok)
    assert 2000 <= len(examples) <= 4000
    assert all(any(label != IGNORE_INDEX for label in e.labels) for e in examples)
    assert load_examples(RECIPE_DATA / "sample_text.jsonl", "auto", tok)
    DataLoader(examples, batch_size=8, seq_len=128, pad_id=tok.pad_id)

    spec = importlib.util.spec_from_file_location(
        "make_quickstart_data", RECIPE_DATA / "make_quickstart_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.make_rows(len(examples), seed=0)
    committed = [json.loads(line) for line in (RECIPE_DATA / "quickstart.jsonl").read_text().splitlines()]
    assert rows == committed
