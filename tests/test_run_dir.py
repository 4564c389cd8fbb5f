"""The run directory: checked before anything is loaded, never taken over from another run unasked, and a
co-located run's default kept apart from the standalone run's."""

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.colocate.commands import use_colocated_output_dir
from harli_train.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SHORT = ["train.batch_size=2", "data.seq_len=64", "train.warmup_steps=1", "train.device=cpu", "--quiet"]


def _run(out: Path, steps: int, *extra: str):
    args = [str(QUICKSTART), *SHORT, f"train.steps={steps}", f"output.dir={out}", *extra]
    return CliRunner().invoke(main, args)


def test_a_new_run_into_another_runs_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    assert _run(run, 3).exit_code == 0
    before = (run / "checkpoints" / "step_000003" / "trainer_state.json").read_bytes()

    refused = _run(run, 2)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "--resume" in refused.output and "output.overwrite=true" in refused.output, refused.output
    assert str(run) in refused.output and "step_000003" in refused.output
    assert (run / "checkpoints" / "step_000003" / "trainer_state.json").read_bytes() == before

    replaced = _run(run, 2, "output.overwrite=true")
    assert replaced.exit_code == 0, replaced.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def _no_loading(monkeypatch):
    """Make loading the model or the data fail loudly: the output directory must be checked first."""

    def loaded(*args, **kwargs):
        raise AssertionError("the model or data was loaded before the output directory was checked")

    monkeypatch.setattr("harli_train.train.trainer.load_model", loaded)
    monkeypatch.setattr("harli_train.train.validation.load_examples", loaded)


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_an_unusable_output_dir_is_a_usage_error_before_anything_loads(tmp_path, monkeypatch, where):
    _no_loading(monkeypatch)
    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    out = blocker if where == "file" else blocker / "run"
    result = _run(out, 2)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "output.dir" in error and str(out) in error
    assert ("which is a file" if where == "file" else f"under the file {blocker}") in error


def test_an_unwritable_output_dir_is_a_usage_error_before_anything_loads(tmp_path, monkeypatch):
    _no_loading(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: the write check then fails as it would for anyone else

        def denied(dir, prefix):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(Path(dir) / prefix))

        monkeypatch.setattr("harli_train.durable.tempfile.mkstemp", denied)
    try:
        result = _run(locked / "run", 2)
    finally:
        locked.chmod(0o700)
    assert result.exit_code == 2 and "Permission denied" in result.output and str(locked) in result.output


def test_an_empty_checkpoint_folder_left_by_a_kill_is_removed_at_the_next_start(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    result = _run(run, 2)
    assert result.exit_code == 0, result.output  # an empty folder is no checkpoint to protect
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]


def test_a_colocated_run_defaults_to_its_own_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe(QUICKSTART)  # output.dir: runs/quickstart, the default for its stem
    use_colocated_output_dir(cfg)
    assert cfg.output.dir == str(tmp_path.resolve() / "runs" / "quickstart-colocated")
    chosen = load_recipe(QUICKSTART, ["output.dir=elsewhere"])
    use_colocated_output_dir(chosen)
    assert chosen.output.dir == str(tmp_path.resolve() / "elsewhere")
    # The README's order: a standalone run, then the same recipe co-located, each in its own directory.
    standalone = CliRunner().invoke(main, [str(QUICKSTART), *SHORT, "train.steps=2"])
    assert standalone.exit_code == 0, standalone.output
    colocated = CliRunner().invoke(
        main, [str(QUICKSTART), *SHORT, "train.steps=2", "--colocate-with", "tiny", "colocation.duration_s=1"]
    )
    assert colocated.exit_code == 0, colocated.output
    summary = json.loads(
        (tmp_path / "runs" / "quickstart-colocated" / "colocate" / "summary.json").read_text()
    )
    assert summary["trainer"]["steps"] == 2 and (tmp_path / "runs" / "quickstart" / "adapter").is_dir()
    # --resume on the co-located form continues the co-located run.
    resumed = CliRunner().invoke(
        main,
        [
            str(QUICKSTART),
            *SHORT,
            "train.steps=3",
            "--colocate-with",
            "tiny",
            "colocation.duration_s=1",
            "--resume",
        ],
    )
    assert resumed.exit_code == 0, resumed.output
    assert len((tmp_path / "runs" / "quickstart-colocated" / "metrics.jsonl").read_text().splitlines()) == 3


def test_writable_folder_makes_the_folder_and_names_a_file_in_its_way(tmp_path):
    """``durable.writable_folder`` (the output directory's check and the profile's): the folder and its
    parents are made, the probe file leaves nothing behind, and a file where a folder should be is named."""
    from harli_train.durable import writable_folder

    writable_folder(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())
    (tmp_path / "f").write_text("")
    for inside in (tmp_path / "f", tmp_path / "f" / "g"):
        with pytest.raises(NotADirectoryError) as err:
            writable_folder(inside)
        assert err.value.filename == str(tmp_path / "f")
