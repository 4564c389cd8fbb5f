"""Writing a Hugging Face model directory: safetensors shards (and their index), config and side files,
staged in a hidden sibling folder and renamed into place, so an output directory is never left half-written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harli_train.export import ExportError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The files transformers' tokenizers read or write (slow and fast, chat templates): copied when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size ("5GB")


@dataclass(frozen=True, slots=True)
class TensorSource:
    """One tensor to write: its name, shape and dtype as written, and how to make it (called once, when its
    shard is written, so only one shard's tensors are in memory at a time)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def check_out_dir(path: Path) -> None:
    """ExportError unless `path` is absent or an empty directory (an export never writes over files)."""
    if path.is_dir():
        if any(path.iterdir()):
            raise ExportError(f"{path}: the output directory exists and is not empty (choose a new one)")
    elif path.exists():
        raise ExportError(f"{path}: exists and is not a directory")


@contextlib.contextmanager
def staged_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty hidden folder beside `out_dir` to write into; on success it is renamed to `out_dir`
    (an empty `out_dir` is replaced), on any error or interrupt it is removed. ExportError (before anything
    is written) when `out_dir` exists and is not an empty directory."""
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield stage
        _share_like_umask(stage)
        check_out_dir(out)  # something may have appeared there meanwhile
        if out.is_dir():
            out.rmdir()
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _share_like_umask(folder: Path) -> None:
    """Give `folder` and its files the modes a plain mkdir / open would (mkdtemp makes the folder 0700 and
    safetensors writes files 0600): an exported model is for others to read."""
    mask = os.umask(0)  # Python has no getter for the umask: set and restore it
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~mask)


def plan_shards(sources: Sequence[TensorSource], max_shard_bytes: int) -> list[list[TensorSource]]:
    """Consecutive groups of `sources` of at most `max_shard_bytes` each (a larger tensor alone)."""
    shards: list[list[TensorSource]] = []
    size = 0
    for src in sources:
        if not shards or (size + src.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(src)
        size += src.nbytes
    return shards


def write_weights(folder: Path, sources: Sequence[TensorSource], max_shard_bytes: int) -> list[str]:
    """Write `sources` as transformers lays weights out: `model.safetensors` when they fit in one shard, else
    `model-0000i-of-0000n.safetensors` files and `model.safetensors.index.json`; returns the file names."""
    from safetensors.torch import save_file

    if len({s.name for s in sources}) != len(sources):
        raise ValueError("tensor names must be unique")
    shards = plan_shards(sources, max_shard_bytes)
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        tensors = {}
        for src in shard:
            tensor = src.load().detach()
            if tuple(tensor.shape) != src.shape or tensor.dtype != src.dtype:
                raise ValueError(f"{src.name}: made {tensor.dtype} {tuple(tensor.shape)}, planned {src}")
            tensors[src.name] = tensor.contiguous()  # safetensors refuses strided views
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in sources)}, "weight_map": weight_map}
        write_json(folder / INDEX_NAME, index)
        names.append(INDEX_NAME)
    return names


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of HF directory `src` that exist (TOKENIZER_FILES); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def dtype_name(dtype: torch.dtype) -> str:
    """The name config.json uses for a dtype ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")
