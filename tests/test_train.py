"""The trainer: micro-steps equal a whole step, resume continues the same curve, the quickstart learns."""

import io
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from rich.console import Console

from harli_train import kernels
from harli_train.cli import main
from harli_train.config import load_recipe
from harli_train.model import load_model
from harli_train.train.divergence import TrainingDiverged
from harli_train.train.metrics import progress_bar
from harli_train.train.step import train_step
from harli_train.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def _drain(gen):
    phases = []
    try:
        while True:
            phases.append(next(gen).phase)
    except StopIteration as stop:
        return stop.value, phases


def _batch(seed, b=2, t=24, vocab=320):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (b, t), generator=g)
    labels = ids.clone()
    labels[:, : t // 3] = -100
    return {"input_ids": ids, "labels": labels, "num_target_tokens": int((labels[:, 1:] != -100).sum())}


def _model():
    m = load_model("tiny", torch.float32, "cpu", seed=1)
    m.add_lora(4, 8.0, 0.0, seed=2)
    with torch.no_grad():
        for p in m.lora_parameters():
            p.normal_(0, 0.05)  # non-zero B so every gradient is non-trivial
    return m


def _grads(m):
    return [p.grad.clone() for p in m.lora_parameters()]


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_micro_stepped_step_equals_whole_graph_step(per_chunk):
    batches = [_batch(1), _batch(2)]
    m = _model()
    # Reference: one ordinary forward/backward over both micro-batches, mean over all target tokens.
    total = sum(b["num_target_tokens"] for b in batches)
    for b in batches:
        logits = m.logits(m(b["input_ids"]))
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            b["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (loss / total).backward()
    ref = _grads(m)
    m.zero_grad(set_to_none=True)
    result, phases = _drain(train_step(m, batches, per_chunk))
    n_chunks = -(-m.config.num_layers // per_chunk)
    assert phases.count("fwd") == 2 * n_chunks and phases.count("bwd") == 2 * n_chunks
    assert result.target_tokens == total
    for got, want in zip(_grads(m), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _dropout_model(dropout):
    torch.manual_seed(7)
    m = _model()
    for mod in m.modules():
        if getattr(mod, "rank", 0):
            mod.dropout = dropout
    return m.train()  # as the trainer runs it (dropout is on)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_rebuilt_chunks_give_the_same_gradients(dropout):
    # A runtime may ask for a chunk's forward to be rebuilt just before its backward (the SMs its first
    # forward ran on went to decode): the gradients stay exactly those of the plain step, dropout included
    # (the rebuild replays the RNG its first forward drew from), and the RNG ends where the plain step left it.
    batches = [_batch(1), _batch(2)]

    def run(recompute, seed=11):
        m = _dropout_model(dropout)
        torch.manual_seed(seed)
        result, _ = _drain(train_step(m, batches, 1, recompute=recompute))
        return _grads(m), result.loss_sum, torch.rand(3)

    asked = []

    def every_other(mb, start):
        asked.append((mb, start))
        return start % 2 == 0

    plain, rebuilt = run(None), run(every_other)
    n = _model().config.num_layers
    assert asked == [(mb, s) for mb in (0, 1) for s in reversed(range(n))]  # once per backward chunk
    for got, want in zip(rebuilt[0], plain[0], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(rebuilt[1], plain[1]) and torch.equal(rebuilt[2], plain[2])
    if dropout:  # not vacuous: other masks give other gradients
        assert not torch.equal(run(None, seed=12)[0][0], plain[0][0])


def _recipe(tmp_path, **over):
    base = {
        "train.steps": 12,
        "train.warmup_steps": 2,
        "train.batch_size": 4,
        "data.seq_len": 64,
        "output.checkpoint_every": 5,
        "lora.dropout": 0.1,
        "train.log_every": 100,
        "output.dir": str(tmp_path / "run"),
        "train.device": "cpu",
    }
    base.update(over)
    return load_recipe(QUICKSTART, [f"{k}={v}" for k, v in base.items()])


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The loss curve of `_recipe`'s run without interruption."""
    out = tmp_path_factory.mktemp("uninterrupted")
    full = Trainer(_recipe(out), quiet=True)
    full.setup()
    full.train()
    return _losses(out / "run")


@pytest.mark.parametrize("phase, kept", [("bwd", 7), ("optim", 8)])
def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path, phase, kept, uninterrupted):
    want = uninterrupted
    assert len(want) == 12

    # Interrupted in the middle of step 8 (after 7 completed steps), as Ctrl-C would.
    part = Trainer(_recipe(tmp_path), quiet=True)
    part.setup()
    for ms in part.micro_steps():
        if part.step == 7 and ms.phase == "bwd":
            part.interrupt()
            break
    summary = part.finish()
    assert (
        summary["interrupted"] and summary["steps"] == 7 and Path(summary["checkpoint"]).name == "step_000007"
    )

    resumed = Trainer(_recipe(tmp_path), quiet=True)
    resumed.setup(resume=tmp_path / "run")
    assert resumed.step == 7
    resumed.train()
    got = _losses(tmp_path / "run")
    assert len(got) == len(want) and got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_checkpoints_rotate_and_final_adapter_is_written(tmp_path):
    cfg = _recipe(tmp_path, **{"output.checkpoint_every": 2, "output.keep_checkpoints": 2, "train.steps": 7})
    t = Trainer(cfg, quiet=True)
    t.setup()
    summary = t.train()
    run = Path(cfg.output.dir)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006", "step_000007"]
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and (run / "recipe.yaml").is_file()
    assert summary["steps"] == 7
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"} <= set(rec)


@pytest.mark.slow
def test_quickstart_loss_falls(tmp_path):
    result = CliRunner().invoke(main, [str(QUICKSTART), f"output.dir={tmp_path / 'qs'}", "--quiet"])
    assert result.exit_code == 0, result.output
    losses = _losses(tmp_path / "qs")
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    assert (tmp_path / "qs" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("width", [80, 64])
def test_the_progress_bar_keeps_its_step_count_and_time_left_in_a_narrow_terminal(width):
    # At 80 columns the bar, "60/300" and the time left once vanished behind the status text.
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    clock = [0.0]
    bar = progress_bar(console=console, get_time=lambda: clock[0])
    task = bar.add_task("train", total=300, completed=0, status="")
    status = "loss 1.2345  lr 3.00e-03  |g| 0.123  1,234 tok/s  0.40 GiB  epoch 0.25"
    for step in range(1, 61):  # 2 s a step
        clock[0] += 2.0
        bar.update(task, completed=step, status=status)
    console.print(bar.get_renderable())
    line = out.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= width, line
    assert line.startswith("train ━━━━ ") and " 60/300 " in line  # a fifth of 20 cells
    assert " 0:08:00 " in line  # 240 steps left at 2 s each
    assert "loss 1.2345" in line and line.endswith("…")  # the status gives way, cut on one line


def test_seq_len_past_the_model_context_is_a_recipe_error():
    result = CliRunner().invoke(main, [str(QUICKSTART), "data.seq_len=4096"])  # tiny's context: 2048 tokens
    assert result.exit_code == 2, result.output
    assert "data.seq_len" in result.output and "context of model 'tiny' (2048 tokens" in result.output
    assert "got 4096" in result.output and "Traceback" not in result.output


def test_warmup_at_or_past_the_run_length_is_clamped_with_a_warning(tmp_path, caplog):
    # The quickstart warms up for 20 steps; `train.steps=6` must still run, warming up for 5.
    run = tmp_path / "run"
    args = ["train.steps=6", "train.batch_size=2", "data.seq_len=32", f"output.dir={run}", "--quiet"]
    with caplog.at_level("WARNING"):
        result = CliRunner().invoke(main, [str(QUICKSTART), *args])
    assert result.exit_code == 0, result.output
    warned = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert warned == ["train.warmup_steps (20) is not below the run's 6 steps: warming up for 5 instead"]
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    base = 3.0e-3  # the quickstart's train.lr
    assert lrs[:5] == pytest.approx([base * k / 5 for k in range(1, 6)]) and lrs[5] == pytest.approx(base)
    assert "warmup_steps: 5" in (run / "recipe.yaml").read_text()


def test_a_diverged_run_stops_and_keeps_the_last_finite_checkpoint(tmp_path):
    # lr 1e30 is finite (the recipe takes it): step 1 is finite, its update makes the weights ~1e30, and
    # step 2's loss is nan. The run must stop there with one line, exit 1, and save nothing of step 2.
    run = tmp_path / "run"
    args = ["train.lr=1e30", "train.steps=5", "train.warmup_steps=0", "train.batch_size=2"]
    args += ["data.seq_len=32", "output.checkpoint_every=1", f"output.dir={run}", "--quiet"]
    result = CliRunner().invoke(main, [str(QUICKSTART), *args])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output
    assert "diverged at step 2: the loss is nan" in errors[0] and "step_000001" in errors[0]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert not (run / "adapter").exists()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_non_finite_gradient_norm_stops_the_run(tmp_path, monkeypatch):
    # A finite loss with an inf gradient norm (an overflow in the backward) stops the run just the same.
    t = Trainer(_recipe(tmp_path, **{"train.steps": 3, "output.checkpoint_every": 0}), quiet=True)
    t.setup()
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def overflow_at_step_2(params, max_norm):
        calls.append(real(params, max_norm))
        return torch.tensor(float("inf")) if len(calls) == 2 else calls[-1]

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", overflow_at_step_2)
    with pytest.raises(TrainingDiverged) as info:
        t.train()
    assert info.value.step == 2 and info.value.what == "gradient norm" and info.value.checkpoint is None
    assert "no checkpoint was written" in str(info.value) and t.step == 1
    assert not (Path(t.cfg.output.dir) / "adapter").exists()


def test_resuming_from_a_truncated_checkpoint_adapter_names_the_file(tmp_path):
    run = tmp_path / "run"
    args = [str(QUICKSTART), "train.steps=2", "train.warmup_steps=0", "train.batch_size=2", "data.seq_len=32"]
    args += [f"output.dir={run}", "--quiet"]
    assert CliRunner().invoke(main, args).exit_code == 0
    weights = run / "checkpoints" / "step_000002" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    result = CliRunner().invoke(main, [*args, "train.steps=4", "--resume"])
    lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(f"Error: {weights}: not a readable safetensors file")


def test_an_output_dir_that_cannot_be_made_gives_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cases = [a_file, a_file / "run"] + ([locked / "run"] if os.geteuid() != 0 else [])  # root writes anyway
    for out in cases:
        result = CliRunner().invoke(main, [str(QUICKSTART), "train.steps=1", f"output.dir={out}", "--quiet"])
        lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
        assert result.exit_code != 0 and len(lines) == 1 and "Traceback" not in result.output, result.output
        assert lines[0].startswith("Error: ") and str(out) in lines[0]


def test_cli_reports_bad_recipe_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    data = ROOT / "recipes" / "data" / "quickstart.jsonl"
    bad.write_text(f"data:\n  path: {data}\ntrain:\n  lr: fast\n")
    result = CliRunner().invoke(main, [str(bad)])
    assert result.exit_code != 0
    assert "bad.yaml" in result.output and "train.lr" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, [str(tmp_path / "missing.yaml")])
    assert result.exit_code != 0 and "missing.yaml" in result.output


def test_cli_generate_with_a_trained_adapter(tmp_path):
    cfg = _recipe(tmp_path, **{"train.steps": 3, "train.warmup_steps": 1})
    t = Trainer(cfg, quiet=True)
    t.setup()
    adapter = t.train()["adapter"]
    result = CliRunner().invoke(
        main, ["generate", "--prompt", "add 12+34 =", "--adapter", adapter, "--max-tokens", "4"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("add 12+34 =")
    result = CliRunner().invoke(main, ["generate", "--prompt", "x", "--adapter", str(tmp_path)])
    assert result.exit_code != 0 and "adapter_config.json not found" in result.output


def test_cli_colocate_with_runs_both_sides(tmp_path):
    out = tmp_path / "colo"
    result = CliRunner().invoke(
        main,
        [
            str(QUICKSTART),
            "--colocate-with",
            "tiny",
            "--quiet",
            "train.steps=4",
            "train.warmup_steps=1",
            "colocation.duration_s=3",
            "data.val_fraction=0.01",
            "train.eval_every=2",
            f"output.dir={out}",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "colocate" / "summary.json").read_text())
    assert summary["trainer"]["steps"] == 4 and summary["trainer"]["eval_loss"] > 0
    assert [r["step"] for r in _records(out) if "eval_loss" in r] == [2, 4]  # evaluated beside decode too
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "colocate" / "timeline.png").is_file() and (out / "colocate" / "steps.jsonl").is_file()


def test_triton_kernels_where_they_cannot_run_are_a_recipe_error(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = [str(QUICKSTART), "train.kernels=triton", f"output.dir={tmp_path / 'run'}"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # tests/conftest.py sets it
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "train.kernels: expected 'auto' or 'torch' on this machine" in result.output
    assert "'triton', but there is no GPU for it" in result.output and "TRITON_INTERPRET=1" in result.output
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "'triton', but triton cannot be imported" in result.output
    monkeypatch.undo()  # TRITON_INTERPRET=1 again: the interpreter can run them, so they are accepted
    with kernels.use_backend(kernels.get_backend()):  # setup selects the backend process-wide
        Trainer(_recipe(tmp_path, **{"train.kernels": "triton"}), quiet=True).setup()
        assert kernels.get_backend() == "triton"


def test_gpu_recipe_on_a_cpu_machine_names_the_device_key():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for extra in ([], ["--colocate-with", "tiny"]):
        result = CliRunner().invoke(main, [str(ROOT / "recipes" / "llama-8b-lora.yaml"), *extra])
        assert result.exit_code != 0 and "train.device" in result.output and "Traceback" not in result.output


def test_optimizer_state_made_at_setup_steps_as_a_lazy_adamw(tmp_path):
    # The trainer makes AdamW's state at set-up (co-located, its first step would otherwise allocate it while
    # decode serves); the steps that follow must be torch's own AdamW from a fresh start, to the bit.
    tr = Trainer(_recipe(tmp_path, **{"train.weight_decay": 0.1}), quiet=True)
    tr.setup()
    opt = tr.optimizer
    assert len(opt.state) == len(tr.params)
    for p in tr.params:
        st = opt.state[p]
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    assert all(p.grad is None for p in tr.params)
    assert [g["lr"] for g in opt.param_groups] == [tr.cfg.train.lr]
    clones = [p.detach().clone().requires_grad_() for p in tr.params]
    g = opt.param_groups[0]
    ref = torch.optim.AdamW(
        clones, lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"]
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, c in zip(tr.params, clones, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            c.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, c in zip(tr.params, clones, strict=True):
        assert torch.equal(p.detach(), c.detach())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[c]["exp_avg_sq"])
        assert float(opt.state[p]["step"]) == float(ref.state[c]["step"]) == 3


@pytest.mark.parametrize(
    ("second", "during", "stops_at"),
    [(signal.SIGINT, "final", 7), (signal.SIGTERM, "final", 7), (signal.SIGTERM, "periodic", 5)],
    ids=["ctrl-c-twice", "ctrl-c-then-sigterm", "sigterm-during-periodic"],
)
def test_a_signal_during_a_checkpoint_lets_it_complete(
    tmp_path, monkeypatch, uninterrupted, second, during, stops_at
):
    """The save in progress completes; a signal during a periodic checkpoint then stops the run, as it would
    have a moment later; one during the final checkpoint is dropped (the run is ending anyway)."""
    from harli_train import durable
    from harli_train.train.checkpoint import is_complete

    part = Trainer(_recipe(tmp_path), quiet=True)
    part.setup()
    if during == "final":  # Ctrl-C in step 8: the interrupt checkpoint of step 7 starts
        original = part.micro_steps

        def ctrl_c_in_step_8():
            for ms in original():
                yield ms
                if part.step == 7 and ms.phase == "bwd":
                    os.kill(os.getpid(), signal.SIGINT)

        part.micro_steps = ctrl_c_in_step_8
    real, sent = durable.write_file, []

    def signal_mid_save(path, data):  # the signal arrives with the checkpoint half written
        if f".tmp_step_{stops_at:06d}" in str(path) and not sent:
            sent.append(path)
            os.kill(os.getpid(), second)
        real(path, data)

    monkeypatch.setattr(durable, "write_file", signal_mid_save)
    summary = part.train()
    monkeypatch.undo()
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{stops_at:06d}"
    assert sent and summary["interrupted"] and summary["steps"] == stops_at
    assert is_complete(ckpt) and Path(summary["checkpoint"]) == ckpt
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp_*"))

    resumed = Trainer(_recipe(tmp_path), quiet=True)
    resumed.setup(resume=tmp_path / "run")
    assert resumed.step == stops_at
    resumed.train()
    assert _losses(tmp_path / "run") == pytest.approx(uninterrupted, rel=1e-6, abs=1e-7)


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    from harli_train.train.checkpoint import CheckpointError
    from harli_train.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(records) + '\n{"step": 4, "loss": 0.2')  # killed while writing step 4
    MetricsLogger(path, 10, 1, resume_step=3, quiet=True).close()
    assert path.read_text().splitlines() == records
    path.write_text(records[0] + '\n{"step": 2, "lo\n' + records[2] + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl: line 2 is not a metrics record"):
        MetricsLogger(path, 10, 1, resume_step=3, quiet=True)


def test_resume_of_a_finished_run_prints_strict_json(tmp_path):
    args = [str(QUICKSTART), "--quiet", "train.steps=2", "train.warmup_steps=1", "train.batch_size=2"]
    args += ["data.seq_len=64", f"output.dir={tmp_path / 'run'}"]
    assert CliRunner().invoke(main, args).exit_code == 0
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads(result.stdout, parse_constant=refuse)
    assert summary["steps"] == 2 and summary["loss"] is None  # no step ran: no loss


@pytest.mark.parametrize("per_chunk, accum", [(1, 1), (3, 2)])
def test_the_tracker_foresees_every_micro_step_the_step_runs(per_chunk, accum):
    # One statement of the step's order (step_order): train_step runs it, MicroTracker.next_kind reads it.
    from harli_train.colocate.micro_tracker import MicroTracker
    from harli_train.train.step import MicroStep, step_order

    m = _model()
    batches = [_batch(i) for i in range(accum)]
    ran = list(train_step(m, batches, per_chunk)) + [MicroStep("optim", accum - 1)]
    assert ran == step_order(m.config.num_layers, per_chunk, accum)
    tracker = MicroTracker(m.config.num_layers, per_chunk, accum)
    for ms, want in zip(ran, ["next"] + [m.phase for m in ran[1:]], strict=True):  # "next": a step boundary
        assert tracker.next_kind() == want
        tracker.track(ms, 0)
    assert tracker.next_kind() == "next" and tracker.micro_per_step == len(ran)
