"""Data files: JSON, Parquet and CSV read as JSON Lines does, alone or mixed in a folder; their errors name the
file and row; Parquet without pyarrow says what to install."""

import json
from pathlib import Path

import pytest

from harli_train.data import ByteTokenizer, DataError, load_examples

from .test_data import write_jsonl

ROWS = [
    {"prompt": "p1", "completion": "c1"},
    {"prompt": "p2 \u00e9", "completion": 'c2,\n"quoted"'},
    {"prompt": "p3", "completion": ""},
]


def write_csv(path: Path, rows: list[dict]) -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_json_parquet_and_csv_read_as_jsonl_does(tmp_path):
    pytest.importorskip("pyarrow")
    tok = ByteTokenizer()
    want = load_examples(write_jsonl(tmp_path / "d.jsonl", ROWS), "auto", tok)
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=2))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # datasets' to_json
    for path in (
        tmp_path / "array.json",
        tmp_path / "lines.json",
        write_parquet(tmp_path / "d.parquet", ROWS),
        write_csv(tmp_path / "d.csv", ROWS),
    ):
        assert load_examples(path, "auto", tok) == want, path.name
    # A folder of mixed files: name order (array.json, d.csv, d.jsonl, d.parquet, lines.json), rows in order.
    assert load_examples(tmp_path, "auto", tok) == want * 5
    assert load_examples(tmp_path, "auto", tok, max_examples=4) == want + want[:1]


def test_chat_rows_from_parquet_keep_their_messages(tmp_path):
    pytest.importorskip("pyarrow")
    from harli_train.data.files import read_rows

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    ((where, row),) = read_rows(write_parquet(tmp_path / "chat.parquet", rows))
    assert row == rows[0] and where == f"{tmp_path / 'chat.parquet'}: row 1"


def test_file_type_errors_name_the_file_and_row(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "a.json").write_text(json.dumps([{"text": "a"}, ["not", "an", "object"]]))
    with pytest.raises(
        DataError, match=r"a.json: row 2: expected a JSON object per row of the array, got list"
    ):
        load_examples(tmp_path / "a.json", "auto", tok)
    (tmp_path / "b.json").write_text('[{"text": "a"},\n {"text": ]')
    with pytest.raises(DataError, match=r"b.json:2: invalid JSON"):
        load_examples(tmp_path / "b.json", "auto", tok)
    (tmp_path / "c.csv").write_text("text\nfine\ntoo,many\n")
    with pytest.raises(DataError, match=r"c.csv:3: more cells than the header has columns \(1\)"):
        load_examples(tmp_path / "c.csv", "auto", tok)
    (tmp_path / "d.csv").write_text("prompt,completion\nonly a prompt\n")
    with pytest.raises(DataError, match=r"d.csv:2: missing field 'completion'"):
        load_examples(tmp_path / "d.csv", "auto", tok)
    (tmp_path / "e.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"e.parquet: not a readable Parquet file"):
        load_examples(tmp_path / "e.parquet", "auto", tok)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DataError) as e:
        load_examples(tmp_path / "d.parquet", "auto", ByteTokenizer())
    assert str(e.value) == (
        f"{tmp_path / 'd.parquet'}: reading Parquet needs pyarrow (pip install pyarrow, or pip install "
        "'harli-train[parquet]')"
    )
