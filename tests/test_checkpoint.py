"""Checkpoints: stored without pickle and read back exactly, a pickled or damaged one refused by name, and a
save that is cut short (a kill, a full disk) never costing the checkpoint before it."""

import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from harli_train import durable
from harli_train.adapter import save_adapter
from harli_train.cli import main
from harli_train.config import load_recipe
from harli_train.model import load_model
from harli_train.train.checkpoint import (
    FILES,
    LEGACY_STATE,
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    SaveError,
    find_checkpoint,
    is_complete,
    list_checkpoints,
    recover_checkpoints,
)
from harli_train.train.trainer import Trainer
from harli_train.train.trainer_state import decode, encode, rng_state, set_rng_state

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SHORT = ["train.batch_size=2", "data.seq_len=64", "train.warmup_steps=1", "train.device=cpu", "--quiet"]


def _run(out: Path, steps: int, *extra: str):
    """The quickstart recipe through the command line, ``steps`` short steps into ``out``."""
    args = [str(QUICKSTART), *SHORT, f"train.steps={steps}", f"output.dir={out}", *extra]
    return CliRunner().invoke(main, args)


def _trainer(out: Path, steps: int = 4, **over) -> Trainer:
    overrides = {
        "train.steps": steps,
        "train.batch_size": 2,
        "data.seq_len": 64,
        "train.warmup_steps": 1,
        "train.device": "cpu",
        "output.dir": str(out),
        **over,
    }
    tr = Trainer(load_recipe(QUICKSTART, [f"{k}={v}" for k, v in overrides.items()]), quiet=True)
    return tr


# ---- the format ---------------------------------------------------------------------------------------


def test_trainer_state_round_trips_exactly_through_json_and_safetensors():
    from safetensors.torch import load, save

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    random.random(), np.random.rand(), torch.rand(1)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = {
        "step": 3,
        "tokens_seen": 1234,
        "loader": {"epoch": 1, "step": 2},
        "recipe": {"train": {"lr": 1e-3}},
        "optimizer": opt.state_dict(),
        "rng": rng_state(),
    }
    plain, tensors = encode(state)
    back = decode(json.loads(json.dumps(plain)), load(save(tensors)))

    assert {k: back[k] for k in ("step", "tokens_seen", "loader", "recipe")} == {
        k: state[k] for k in ("step", "tokens_seen", "loader", "recipe")
    }
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # betas a tuple again
    want = state["optimizer"]["state"]
    assert back["optimizer"]["state"].keys() == want.keys()
    for index, per_param in want.items():
        assert back["optimizer"]["state"][index].keys() == per_param.keys()
        for name, value in per_param.items():
            assert torch.equal(back["optimizer"]["state"][index][name], value)
    # The generators continue exactly where they were.
    set_rng_state(state["rng"])
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(3))
    set_rng_state(back["rng"])
    got = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    fresh.load_state_dict(back["optimizer"])  # what the trainer does on resume
    assert fresh.param_groups[0]["betas"] == (0.8, 0.95)


def test_a_pickled_checkpoint_is_refused_and_its_payload_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    # An old-format checkpoint: the adapter beside a pickled trainer_state.pt whose unpickling runs a command.
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    model = load_model("tiny", torch.float32, "cpu")
    model.add_lora(16, 32.0, 0.0)
    save_adapter(model, ckpt, base_model="tiny")
    torch.save({"step": 3, "rng": Payload()}, ckpt / LEGACY_STATE)

    for how in (
        ["--resume-from", str(ckpt)],
        ["--resume-from", str(ckpt / LEGACY_STATE)],
        ["--resume-from", str(tmp_path / "run")],
        ["--resume"],
    ):
        result = _run(tmp_path / "run", 4, *how)
        assert result.exit_code != 0, (how, result.output)
        assert str(ckpt / LEGACY_STATE) in result.output and "cannot be resumed safely" in result.output, how
        assert "Traceback" not in result.output
        assert not marker.exists(), f"the pickle's payload ran ({how})"
    # A new run into that directory is refused too: the old checkpoint is another run's work.
    assert _run(tmp_path / "run", 4).exit_code == 2 and (ckpt / LEGACY_STATE).is_file()
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda ck: (ck / STATE_JSON).write_text("{ torn"),
        lambda ck: (ck / STATE_JSON).write_text(json.dumps({"step": 4})),  # JSON, but no trainer state
        lambda ck: (ck / STATE_TENSORS).write_bytes((ck / STATE_TENSORS).read_bytes()[:100]),  # truncated
    ],
    ids=["bad-json", "foreign-json", "truncated-tensors"],
)
def test_a_damaged_checkpoint_gets_one_error_naming_the_file(tmp_path, damage):
    assert _run(tmp_path / "run", 2).exit_code == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    damage(ckpt)
    result = _run(tmp_path / "run", 4, "--resume")
    assert result.exit_code != 0 and "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and str(ckpt) in error[0], result.output


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    stray = tmp_path / "notes.txt"
    stray.write_text("hello")
    with pytest.raises(CheckpointError, match="notes.txt: not a checkpoint"):
        find_checkpoint(stray)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        find_checkpoint(tmp_path)


# ---- saves cut short ----------------------------------------------------------------------------------


def test_a_kill_mid_save_keeps_the_previous_checkpoint_and_the_next_start_cleans_up(tmp_path, monkeypatch):
    tr = _trainer(tmp_path / "run", steps=4, **{"output.checkpoint_every": 2})
    tr.setup()
    real = durable.write_file

    def killed_at_step_4(path, data):
        if ".tmp_step_000004" in str(path) and Path(path).name == STATE_JSON:
            raise SystemExit("killed")  # stands for SIGKILL: nothing after this line runs
        real(path, data)

    monkeypatch.setattr(durable, "write_file", killed_at_step_4)
    with pytest.raises(SystemExit):
        tr.train()
    monkeypatch.undo()
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_000002"]
    assert (ckpts / ".tmp_step_000004").is_dir() and not is_complete(ckpts / ".tmp_step_000004")
    (ckpts / "step_000003").mkdir()  # an empty folder, as a kill can leave

    resumed = _trainer(tmp_path / "run", steps=4)
    resumed.setup(resume=tmp_path / "run")
    assert resumed.step == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"]  # the partial and the empty one gone


def test_a_complete_temporary_checkpoint_is_promoted_at_start_up(tmp_path):
    assert _run(tmp_path / "run", 3).exit_code == 0
    ckpts = tmp_path / "run" / "checkpoints"
    # Killed between writing the last file and renaming the folder into place.
    (ckpts / "step_000003").rename(ckpts / ".tmp_step_000003")
    # Found and promoted at start-up: a checkpoint that a new run is refused to take over.
    assert _run(tmp_path / "run", 3).exit_code == 2
    assert is_complete(ckpts / "step_000003") and not (ckpts / ".tmp_step_000003").exists()
    (ckpts / "step_000003").rename(ckpts / ".tmp_step_000003")
    result = _run(tmp_path / "run", 5, "--resume")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 5
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 5  # 3 kept, 2 run


def test_recovery_removes_partial_folders_and_an_empty_checkpoints_folder(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_000007").mkdir(parents=True)
    (ckpts / ".tmp_step_000008").mkdir()
    (ckpts / ".tmp_step_000008" / FILES[0]).write_text("{}")
    (ckpts / ".del_step_000001").mkdir()
    recover_checkpoints(tmp_path)
    assert not ckpts.exists()


def test_a_full_disk_at_the_final_save_keeps_the_last_checkpoint_and_exits_1(tmp_path, monkeypatch):
    real = durable.write_file

    def disk_full(path, data):
        if ".tmp_step_000003" in str(path) and Path(path).name == STATE_TENSORS:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(durable, "write_file", disk_full)
    result = _run(tmp_path / "run", 3, "output.checkpoint_every=2")
    monkeypatch.undo()
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    ckpts = tmp_path / "run" / "checkpoints"
    assert str(ckpts / ".tmp_step_000003" / STATE_TENSORS) in error and "[Errno 28]" in error, error
    assert f"{ckpts / 'step_000002'}, is kept" in error
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"] and is_complete(ckpts / "step_000002")
    resumed = _run(tmp_path / "run", 3, "--resume")
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["steps"] == 3, resumed.output


def test_a_failed_save_raises_save_error_naming_the_file(tmp_path, monkeypatch):
    tr = _trainer(tmp_path / "run", steps=2)
    tr.setup()

    def read_only(path, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(durable, "write_file", read_only)
    with pytest.raises(
        SaveError, match=r"step 2: .*adapter_model.safetensors: \[Errno 30\].*there is no earlier one"
    ):
        tr.train()
    assert not (tmp_path / "run" / "checkpoints" / ".tmp_step_000002").exists()
