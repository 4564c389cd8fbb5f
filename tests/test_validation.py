"""Validation: the eval loss on its schedule, in metrics.jsonl, on the progress line and in the summary; equal
to transformers+peft's on the saved adapter; exact resume through evaluations; the recipe keys' errors."""

import pytest
import torch
import torch.nn.functional as F

from harli_train.config import load_recipe
from harli_train.train.trainer import Trainer

from .test_train import QUICKSTART, _recipe, _records


def test_eval_loss_every_eval_every_steps_and_at_the_end(tmp_path, capsys):
    cfg = _recipe(tmp_path, **{"train.steps": 7, "data.val_fraction": 0.01, "train.eval_every": 3})
    t = Trainer(cfg)  # not quiet: log lines on stderr (no terminal here)
    t.setup()
    assert (
        t.loader.num_examples == 3000 - 30 and sum(b["input_ids"].shape[0] for b in t.validation.batches) >= 1
    )
    summary = t.train()
    records = _records(tmp_path / "run")
    evaluated = [r["step"] for r in records if "eval_loss" in r]
    assert evaluated == [3, 6, 7]
    assert summary["eval_loss"] == records[-1]["eval_loss"] and 0 < summary["eval_loss"] < 10
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step")]
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [3, 6, 7]  # log_every is 100
    assert f"eval {records[2]['eval_loss']:.4f}" in lines[0]


def test_eval_loss_equals_transformers_and_peft_on_the_saved_adapter(tmp_path):
    # The trainer's eval loss (packed rows, block-diagonal mask) against the mean token loss that peft's
    # model gives each validation example alone.
    from peft import PeftModel

    from harli_train.data import load_examples, load_tokenizer

    from .hf_tokenizers import build_hf_model_dir
    from .test_data import write_jsonl

    hf, _ = build_hf_model_dir(tmp_path / "model", "qwen2.5", std=0.05)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ]
        }
        for i in range(30)
    ]
    train, val = (
        write_jsonl(tmp_path / "train.jsonl", rows[:24]),
        write_jsonl(tmp_path / "val.jsonl", rows[24:]),
    )
    over = {"model.name": tmp_path / "model", "data.path": train, "data.val_path": val, "data.format": "chat"}
    cfg = _recipe(tmp_path, **over, **{"train.steps": 3, "train.batch_size": 2, "data.seq_len": 128})
    t = Trainer(cfg, quiet=True)
    t.setup()
    summary = t.train()
    peft_model = PeftModel.from_pretrained(hf, summary["adapter"]).eval()
    total, count = 0.0, 0
    for e in load_examples(val, "chat", load_tokenizer(str(tmp_path / "model"), is_preset=False)):
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1]
        labels = torch.tensor(e.labels[1:])
        total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
        count += int((labels != -100).sum())
    assert summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_resume_with_evaluations_reproduces_the_curve_and_an_interrupted_evaluation_is_dropped(tmp_path):
    over = {"train.steps": 6, "output.checkpoint_every": 3, "data.val_fraction": 0.01, "train.eval_every": 2}
    full = Trainer(_recipe(tmp_path / "a", **over), quiet=True)
    full.setup()
    full.train()
    want = _records(tmp_path / "a" / "run")
    assert [r["step"] for r in want if "eval_loss" in r] == [2, 4, 6]

    part = Trainer(_recipe(tmp_path / "b", **over), quiet=True)
    part.setup()
    for ms in part.micro_steps():
        if part.step == 4 and ms.phase == "eval":  # step 4 counted, its evaluation under way
            part.interrupt()
            break
    assert part.model.training  # the evaluation's eval mode was undone
    assert part.finish()["steps"] == 4
    resumed = Trainer(_recipe(tmp_path / "b", **over), quiet=True)
    resumed.setup(resume=tmp_path / "b" / "run")
    resumed.train()
    got = _records(tmp_path / "b" / "run")
    assert "eval_loss" not in got[3] and want[3].pop("eval_loss") > 0
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=1e-7)
        assert ("eval_loss" in g) == ("eval_loss" in w)
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-6)


@pytest.mark.parametrize(
    "over, key, expected",
    [
        (
            {"data.val_fraction": 0.1, "data.val_path": QUICKSTART.parent / "data" / "quickstart.jsonl"},
            "data.val_fraction",
            "at most one of",
        ),
        ({"data.val_fraction": 1.0}, "data.val_fraction", "expected a number in (0, 1) or null, got 1.0"),
        ({"train.eval_every": -1}, "train.eval_every", "expected an integer >= 0, got -1"),
    ],
)
def test_validation_keys_are_checked(over, key, expected):
    from harli_train.config import RecipeError

    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [f"{k}={v}" for k, v in over.items()])
    assert e.value.key == key and expected in str(e.value)


def test_validation_data_with_nothing_to_learn_is_refused_and_eval_every_alone_warns(tmp_path, caplog):
    from harli_train.data import DataError

    t = Trainer(_recipe(tmp_path, **{"data.val_fraction": 0.01, "data.packing": "false", "data.seq_len": 4}))
    with pytest.raises(
        DataError, match=r"the validation data \(data.val_fraction of .*quickstart.jsonl\) has no token"
    ):
        t.setup()  # each row is cut to its first 4 tokens, all of them prompt
    t = Trainer(_recipe(tmp_path / "b", **{"train.eval_every": 5}), quiet=True)
    t.setup()
    assert t.validation is None and "train.eval_every is set, but there is no validation data" in caplog.text
