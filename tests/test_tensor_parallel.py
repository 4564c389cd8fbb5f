"""Tensor parallelism on the CPU: 2 gloo ranks against the single-process engine and trainer.

Each test spawns its ranks (harli_train.parallel.group.spawn); a rank's checks run inside it and it writes
what it found to a JSON file the test reads, so a failed check names the rank.
"""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from harli_train.cli import main
from harli_train.config import load_recipe
from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
from harli_train.model import PRESETS, load_model
from harli_train.model.config import ModelError
from harli_train.parallel.command import run_tensor_parallel
from harli_train.parallel.group import check_tensor_parallel, spawn
from harli_train.train.trainer import Trainer

from .servers import launch

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
PROMPTS = [[256, 5, 17, 99, 3], [256, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [256, 7]]
ENGINE = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=12)


def _decode(engine: DecodeEngine) -> list[list[int]]:
    """Greedy tokens of PROMPTS, batched (prefill chunked: 12 tokens a step, decode rows beside it)."""
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    return [s.completion_token_ids for s in seqs]


def _single_decode() -> list[list[int]]:
    model = load_model("tiny", torch.float32, "cpu", seed=0)
    return _decode(DecodeEngine(model, EngineConfig(**ENGINE, overlap=False)))


def _tp_decode(tp, out: str) -> None:
    from harli_train.parallel.command import serving_engine
    from harli_train.parallel.tp_engine import follow_engine, lead_engine, stop_followers

    torch.set_num_threads(1)
    engine = serving_engine("tiny", EngineConfig(**ENGINE), tp, tokenizer=False)
    ids = torch.tensor([[256, 3, 9, 27, 81, 30]])
    logits = engine.model.logits(engine.model(ids))  # every rank: the full vocabulary, gathered
    if not tp.is_leader:
        follow_engine(engine, tp)
        return
    channel = lead_engine(engine, tp)
    tokens = _decode(engine)
    stop_followers(channel)
    Path(out).write_text(json.dumps({"tokens": tokens, "logits": logits[0].tolist()}))


@pytest.mark.slow
def test_sharded_decode_equals_the_single_process_engine(tmp_path):
    out = tmp_path / "tp.json"
    spawn(_tp_decode, 2, False, (str(out),))
    got = json.loads(out.read_text())
    assert got["tokens"] == _single_decode()
    model = load_model("tiny", torch.float32, "cpu", seed=0)
    want = model.logits(model(torch.tensor([[256, 3, 9, 27, 81, 30]])))[0]
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-5, atol=1e-5)


def _recipe(out: Path, **over):
    base = {
        "train.steps": 4,
        "train.warmup_steps": 1,
        "train.batch_size": 2,
        "train.grad_accum": 2,
        "data.seq_len": 64,
        "train.log_every": 100,
        "output.checkpoint_every": 2,
        "output.dir": str(out),
        "train.device": "cpu",
    }
    base.update(over)
    return load_recipe(QUICKSTART, [f"{k}={v}" for k, v in base.items()])


def _metrics(run: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    trainer = Trainer(_recipe(out), quiet=True)
    trainer.setup()
    trainer.train()
    return out


@pytest.mark.slow
def test_sharded_training_equals_single_process_training(tmp_path, single_run):
    run = tmp_path / "tp"
    summary = run_tensor_parallel("train", 2, {"cfg": _recipe(run), "quiet": True}, on_gpu=False)
    assert summary["steps"] == 4
    for key in ("loss", "grad_norm"):
        assert _metrics(run, key) == pytest.approx(_metrics(single_run, key), rel=1e-5)
    # The adapter, gathered from the ranks' slices, is the single-process one in peft's format.
    want = load_file(single_run / "adapter" / "adapter_model.safetensors")
    got = load_file(run / "adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].shape == tensor.shape
        # Adam's update divides by the gradient's root mean square, which magnifies the fp32 rounding of
        # gradients near zero (a few 1e-7) to about 1e-5 of a 3e-3 step.
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-4)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((single_run / "adapter" / "adapter_config.json").read_text())
    # Its checkpoint is a single-process checkpoint: resumed on one process, the run goes on as it did.
    resumed = tmp_path / "resumed"
    trainer = Trainer(_recipe(resumed), quiet=True)
    trainer.setup(resume=run / "checkpoints" / "step_000002")
    trainer.train()
    assert _metrics(resumed, "loss") == pytest.approx(_metrics(single_run, "loss")[2:], rel=1e-5)


@pytest.mark.slow
def test_colocated_tensor_parallel_run_completes(tmp_path):
    out = tmp_path / "colo"
    args = [str(QUICKSTART), "--colocate-with", "tiny", "--tensor-parallel", "2", "--quiet"]
    over = ["train.steps=3", "train.warmup_steps=1", "colocation.duration_s=3", "train.device=cpu"]
    # 3 steps train in about a second: at the recipe's 1 request/s none may have arrived by then.
    over.append("colocation.rate=20")
    result = CliRunner().invoke(main, [*args, *over, f"output.dir={out}"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "colocate" / "summary.json").read_text())
    assert summary["trainer"]["steps"] == 3 and summary["serving"]["requests"] > 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert '"ranks": 2' in result.output


def test_a_tensor_parallel_size_that_does_not_divide_the_model_is_one_line(tmp_path):
    result = CliRunner().invoke(
        main, [str(QUICKSTART), "--tensor-parallel", "3", f"output.dir={tmp_path / 'r'}", "train.device=cpu"]
    )
    assert result.exit_code == 2
    assert (
        "--tensor-parallel 3: must divide the attention heads, KV heads and intermediate size of model 'tiny'"
        in result.output
    )
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["serve", "--model", "tiny", "--tensor-parallel", "0"])
    assert result.exit_code == 2 and "expected a positive number of ranks" in result.output


def test_no_step_runs_ahead_under_tensor_parallelism(tmp_path, monkeypatch, caplog):
    """The ranks replay rank 0's steps as published: the recipe's launch_ahead (on by default) is taken as
    false, with a warning; a policy that asks for steps launched ahead is refused."""
    import harli_train.cli as cli

    runs = []
    monkeypatch.setattr(
        cli, "tensor_parallel_run", lambda kind, n, models, device, args: runs.append(args) or {}
    )
    args = [str(QUICKSTART), "--colocate-with", "tiny", "--tensor-parallel", "2"]
    result = CliRunner().invoke(main, [*args, f"output.dir={tmp_path / 'r'}", "train.device=cpu"])
    assert len(runs) == 1 and runs[0]["cfg"].colocation.launch_ahead is False, result.output
    assert "colocation.launch_ahead is taken as false" in caplog.text
    policy = "colocation.policy=harli:launch=ahead"
    result = CliRunner().invoke(main, [*args, policy, f"output.dir={tmp_path / 'p'}", "train.device=cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "drop its launch=ahead" in result.output and len(runs) == 1


@pytest.mark.slow
def test_a_rank_that_fails_stops_the_job_with_its_error(tmp_path):
    # Every rank fails to read the data file (inside the ranks, after they started): the command ends with
    # the one-line error and exit code one process gives, and no rank is left waiting.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\nnot json\n')
    args = [str(QUICKSTART), "--tensor-parallel", "2", f"data.path={bad}", f"output.dir={tmp_path / 'r'}"]
    result = CliRunner().invoke(main, [*args, "train.device=cpu"])
    assert result.exit_code == 2, result.output
    assert "bad.jsonl" in result.output and "Traceback" not in result.output


def test_llama_70b_preset_has_llama_3_70b_shapes():
    cfg = PRESETS["llama-70b"]
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    assert shape == (8192, 28672, 80, 64, 8) and cfg.vocab_size == 128256
    assert 70.0e9 < cfg.num_params() < 71.0e9
    for n in (2, 4, 8):
        check_tensor_parallel(cfg, n, "llama-70b", on_gpu=False)
    with pytest.raises(ModelError, match="KV heads"):
        check_tensor_parallel(cfg, 16, "llama-70b", on_gpu=False)


@pytest.mark.slow
def test_a_signal_to_the_whole_process_group_stops_the_job_once_and_cleanly(tmp_path):
    """SIGTERM to the command and its process group (what `timeout` sends; systemd and a terminal's Ctrl-C
    signal the group too) reaches rank 0 only through the spawning process: the server stops as asked, exit
    code 0, no rank's error."""
    import os
    import signal
    import urllib.request

    args = [
        "serve",
        "--model",
        "tiny",
        "--tensor-parallel",
        "2",
        "--port",
        "0",
        "--out",
        str(tmp_path / "serve"),
    ]
    proc, url = launch(args, env={"CUDA_VISIBLE_DEVICES": ""}, start_new_session=True)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] == 3
    os.kill(proc.pid, signal.SIGTERM)  # as `timeout` does: the command, then its whole group
    os.killpg(proc.pid, signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err[-2000:]
    assert "Error" not in err and "Traceback" not in err, err[-2000:]
    assert "served 1 requests" in err
