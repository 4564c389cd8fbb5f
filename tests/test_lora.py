"""LoRA against peft: same initial gradients, and adapters that round-trip through peft's format."""

import copy
import json

import peft
import pytest
import torch
from click.testing import CliRunner

from harli_train.adapter import AdapterError, load_adapter, save_adapter
from harli_train.cli import main
from harli_train.model import LORA_TARGETS, load_model
from harli_train.train.step import train_step


def _peft_pair(path, hf, rank=4, alpha=8.0, targets=LORA_TARGETS):
    """peft around the HF model and our model with identical, non-trivial adapter weights."""
    pm = peft.get_peft_model(
        copy.deepcopy(hf),
        peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets)),
    )
    ours = load_model(str(path), torch.float32, "cpu")
    ours.add_lora(rank, alpha, 0.0, targets)
    gen = torch.Generator().manual_seed(5)
    for name, m in ours.lora_modules().items():
        if not m.has_lora:
            continue
        pl = pm.get_submodule(f"base_model.model.{name}")
        with torch.no_grad():
            # B = 0 at init would make A's gradient vanish: use random B on both sides.
            pl.lora_B["default"].weight.copy_(
                torch.randn(pl.lora_B["default"].weight.shape, generator=gen) * 0.1
            )
            m.lora_A.copy_(pl.lora_A["default"].weight)
            m.lora_B.copy_(pl.lora_B["default"].weight)
    return pm, ours


def _batch(vocab, b=2, t=17, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100
    return {"input_ids": ids, "labels": labels, "num_target_tokens": int((labels[:, 1:] != -100).sum())}


def test_init_matches_peft_distribution(tiny_hf_dir):
    path, _ = tiny_hf_dir
    m = load_model(str(path), torch.float32, "cpu")
    m.add_lora(8, 16, 0.0)
    q = m.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B) == 0 and q.scale == 2.0
    assert q.lora_A.abs().max() <= 1 / q.in_features**0.5 and q.lora_A.std() > 0


@pytest.mark.parametrize("per_chunk", [1, 2])
def test_first_step_gradients_equal_peft(tiny_hf_dir, per_chunk):
    path, hf = tiny_hf_dir
    pm, ours = _peft_pair(path, hf)
    batch = _batch(96)
    pm(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    gen = train_step(ours, [batch], per_chunk)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        result = stop.value
    ref_loss = pm(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    assert abs(result.loss_sum.item() / result.target_tokens - ref_loss) < 1e-5
    for name, m in ours.lora_modules().items():
        pl = pm.get_submodule(f"base_model.model.{name}")
        torch.testing.assert_close(m.lora_A.grad, pl.lora_A["default"].weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.lora_B.grad, pl.lora_B["default"].weight.grad, rtol=1e-4, atol=1e-6)


def test_exported_adapter_loads_in_peft_and_reproduces_logits(tiny_hf_dir, tmp_path):
    path, hf = tiny_hf_dir
    _, ours = _peft_pair(path, hf, rank=4, alpha=12.0, targets=("q_proj", "v_proj", "down_proj"))
    out = save_adapter(ours, tmp_path / "adapter", base_model=str(path))
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    ids = _batch(96)["input_ids"]
    with torch.no_grad():
        ref = loaded(input_ids=ids).logits
        got = ours.logits(ours(ids))
        base = hf(input_ids=ids).logits
    assert (ref - base).abs().max() > 1e-3  # the adapter does change the output
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # ... and loads back into a fresh model of ours.
    fresh = load_model(str(path), torch.float32, "cpu")
    cfg = load_adapter(fresh, out)
    assert cfg["r"] == 4 and sorted(fresh.lora_modules(("q_proj",)))
    with torch.no_grad():
        torch.testing.assert_close(fresh.logits(fresh(ids)), got)


def test_peft_saved_adapter_imports(tiny_hf_dir, tmp_path):
    path, hf = tiny_hf_dir
    pm, _ = _peft_pair(path, hf, targets=("k_proj", "gate_proj"))
    pm.save_pretrained(tmp_path / "peft_adapter")
    ours = load_model(str(path), torch.float32, "cpu")
    load_adapter(ours, tmp_path / "peft_adapter")
    ids = _batch(96)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(ids)), pm(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_adapter_errors_name_the_problem(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir
    ours = load_model(str(path), torch.float32, "cpu")
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        load_adapter(ours, tmp_path)
    big = load_model("tiny", torch.float32, "cpu")
    big.add_lora(4, 8, 0.0)
    save_adapter(big, tmp_path / "other")
    with pytest.raises(AdapterError, match="another model"):
        load_adapter(ours, tmp_path / "other")


def _saved_tiny_adapter(out):
    model = load_model("tiny", torch.float32, "cpu")
    model.add_lora(4, 8, 0.0)
    save_adapter(model, out)
    return load_model("tiny", torch.float32, "cpu")  # a fresh model to load it into


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {k: v for k, v in c.items() if k != "r"}, "no 'r' (the LoRA rank, an integer > 0)"),
        (lambda c: {**c, "r": "4"}, "'r' must be the LoRA rank, an integer > 0, got '4'"),
        (lambda c: {**c, "r": 0}, "'r' must be the LoRA rank, an integer > 0, got 0"),
        (lambda c: {k: v for k, v in c.items() if k != "lora_alpha"}, "no 'lora_alpha' (a number > 0)"),
        (lambda c: {**c, "lora_dropout": None}, "'lora_dropout' must be a number in [0, 1), got None"),
        (lambda c: [c], "expected a JSON object (a PEFT LoRA config), got list"),
    ],
)
def test_an_adapter_config_of_the_wrong_shape_names_the_file_and_key(tmp_path, edit, message):
    fresh = _saved_tiny_adapter(tmp_path / "a")
    config = tmp_path / "a" / "adapter_config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    with pytest.raises(AdapterError) as info:
        load_adapter(fresh, tmp_path / "a")
    assert str(info.value) == f"{config}: {message}" + (
        "; a PEFT LoRA config has it" if "no '" in message else ""
    )
    assert not any(m.has_lora for m in fresh.lora_modules().values())  # left as it was


def test_a_truncated_adapter_names_the_file(tmp_path):
    fresh = _saved_tiny_adapter(tmp_path / "a")
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AdapterError) as info:
        load_adapter(fresh, tmp_path / "a")
    assert str(info.value).startswith(f"{weights}: not a readable safetensors file (")
    (tmp_path / "a" / "adapter_config.json").write_bytes(b'{"r": 4, "lora_alpha": 8\xff}')
    with pytest.raises(AdapterError, match="adapter_config.json: invalid JSON"):
        load_adapter(fresh, tmp_path / "a")
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--adapter", str(tmp_path / "a")])
    lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "adapter_config.json: invalid JSON" in lines[0]


def test_merged_adapter_gives_the_same_logits(tiny_hf_dir):
    from harli_train.adapter import merge_adapter

    path, hf = tiny_hf_dir
    _, ours = _peft_pair(path, hf)
    ids = _batch(96)["input_ids"]
    with torch.no_grad():
        want = ours.logits(ours(ids))
        assert merge_adapter(ours) == 3 * 7
        assert not any(m.has_lora for m in ours.lora_modules().values())
        torch.testing.assert_close(ours.logits(ours(ids)), want, rtol=1e-4, atol=1e-5)
