"""One co-located set-up, many runs: ``assemble`` builds the shared weights, ladder, engine and predictor once;
each run gets a fresh policy and trainer on them; the command line and the benchmark both build through it."""

import sys
from pathlib import Path

import pytest
import torch

from harli_train.colocate.assembly import assemble
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.config import load_recipe
from harli_train.engine.load import TraceError, TraceRequest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "train.steps=1000",
    "train.batch_size=2",
    "data.seq_len=32",
    "train.layers_per_microstep=2",
    "train.log_every=1000",
    "output.checkpoint_every=0",
    "colocation.rate=20",
    "colocation.duration_s=0.5",
    "colocation.prompt_len=16",
    "colocation.output_len=8",
    "colocation.max_batch=8",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def recipe(out: Path, *extra: str):
    return load_recipe(ROOT / "recipes" / "quickstart.yaml", [*SMALL, f"output.dir={out}", *extra])


def lora(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def test_runs_on_one_assembly_get_a_fresh_policy_and_trainer(tmp_path):
    longer = [TraceRequest(0.0, 40, prompt_len=200)]  # a load of the caller's, beyond the recipe's own
    col = assemble(recipe(tmp_path / "setup"), "tiny", loads=[longer], spatial=True)
    try:
        assert col.ladder.spatial  # SM partitions on the CPU stand-in, though the recipe's policy is harli
        assert col.engine.engine.config.max_model_len > 240  # sized for the longest request of every load
        assert col.policy.name == "harli" and col.trainer.out_dir == tmp_path / "setup"
        first = col.new_trainer(tmp_path / "a")
        start = lora(first)
        policy = col.prepare(col.new_policy("static:48", 0.2))  # nothing to warm on a CPU
        assert policy.name == "static:48" and policy.tpot_s == 0.2
        opts = RuntimeOptions(until="load", window_s=0.5, quiet=True, finish=False, plots=False)
        summary = col.runtime(policy, col.requests, tmp_path / "a" / "colocate", opts).run()
        assert summary["policy"] == "static:48" and summary["finetune"]["micro_steps"] > 0
        assert any(not torch.equal(start[n], p) for n, p in lora(first).items())  # it trained
        col.predictor.observe(48, True, 1.0, 1e-3)  # a correction learnt in that run ...
        assert col.predictor.correction(48, True) > 1
        harli = col.new_policy()  # ... is not carried into the next policy
        assert harli.name == "harli" and harli.tpot_s == col.tpot_s
        assert col.predictor.correction(48, True) == 1
        second = col.new_trainer(tmp_path / "b")
        assert col.trainer is second and second.model is first.model  # the same weights, a fresh adapter
        assert second.step == 0 and all(torch.equal(start[n], p) for n, p in lora(second).items())
    finally:
        col.close()


def test_a_served_model_or_trace_that_is_not_there_fails_before_the_trainer_is_built(tmp_path, monkeypatch):
    """``--colocate-with`` naming no preset or directory, or a recipe trace that cannot be read, is refused by
    name before the trainer loads its model (on an 8B recipe that is 16 GB read for nothing) or creates its
    output directory."""
    import harli_train.colocate.assembly as assembly
    from harli_train.model import ModelError

    def no_trainer(*args, **kwargs):
        raise AssertionError("the trainer was built")

    monkeypatch.setattr(assembly, "Trainer", no_trainer)
    with pytest.raises(ModelError, match="no-such-model' is neither a preset"):
        assemble(recipe(tmp_path / "run"), str(tmp_path / "no-such-model"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 8}\n')
    with pytest.raises(TraceError, match="bad.jsonl:1: missing key 'output_len'"):
        assemble(recipe(tmp_path / "run", f"colocation.trace={bad}"), "tiny")
    assert not (tmp_path / "run").exists()


def test_the_cli_and_the_bench_build_through_the_same_assemble(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_colocate
    from colocate_load import make_cells

    from harli_train.colocate import assembly, commands

    assert commands.assemble is assembly.assemble and bench_colocate.assemble is assembly.assemble
    calls, graphs = [], []

    class Built(Exception):
        pass

    def assemble(cfg, serve_model, resume=None, **options):
        calls.append((cfg.model.name, serve_model, cfg.colocation.policy, options))
        graphs.append(cfg.train.cuda_graphs)
        raise Built

    monkeypatch.setattr(commands, "assemble", assemble)
    monkeypatch.setattr(bench_colocate, "assemble", assemble)
    with pytest.raises(Built):
        commands.run_colocated(recipe(tmp_path / "cli"), "tiny", policy="static:48")
    argv = [
        "bench_colocate.py",
        "--dry-run",
        "--harli-options",
        "grow=0.1",
        "--set",
        "train.cuda_graphs=true",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    cells = make_cells("steady", ["light"], 15.0, 50)
    with pytest.raises(Built):
        bench_colocate.set_up(bench_colocate.parse_args(), tmp_path / "bench", cells)
    (cli, bench) = calls
    assert cli == ("tiny", "tiny", "static:48", {})  # the recipe's load, its policy, nothing more
    # The bench: the same recipe machinery, its loads to size the engine for and SM partitions on a CPU.
    assert bench[:3] == ("tiny", "tiny", "harli:grow=0.1")
    assert bench[3]["spatial"] and [list(c.requests) for c in cells] == bench[3]["loads"]
    assert graphs == [False, True]  # the bench's --set reaches the recipe


def test_the_bench_sweeps_fixed_splits_without_harli_from_a_given_start(monkeypatch, capsys):
    """``--policies static`` needs harli's peak to start its sweep, or ``--sweep-start`` (a previous
    matrix's ``sweep_start``): the least split giving decode at least that many SMs."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_colocate

    assert bench_colocate.sweep_start([48, 64, 80], 64) == 64
    assert bench_colocate.sweep_start([48, 64, 80], 50) == 64
    assert bench_colocate.sweep_start([48, 64, 80], 120) == 80

    def parse(*args):
        monkeypatch.setattr(sys, "argv", ["bench_colocate.py", "--dry-run", *args])
        return bench_colocate.parse_args()

    assert parse("--policies", "static,temporal", "--sweep-start", "64").sweep_start == 64
    for bad, message in (((), "static needs harli"), (("--sweep-start", "0"), "--sweep-start")):
        with pytest.raises(SystemExit):
            parse("--policies", "static", *bad)
        assert message in capsys.readouterr().err
