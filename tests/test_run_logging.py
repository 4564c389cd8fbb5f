"""Logging beside metrics.jsonl: TensorBoard event files read back by TensorBoard's own reader, a W&B run
(a stand-in module: no network), loss.png, and the recipe errors when a backend is not installed."""

import builtins
import json
import sys
import types
from pathlib import Path

import pytest
from PIL import Image

from harli_train.cli import main
from harli_train.config import RecipeError, load_recipe
from harli_train.train.log_sinks import scalars
from harli_train.train.loss_plot import plot_loss, read_losses
from harli_train.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def _recipe(tmp_path, **over):
    settings = {
        "train.steps": 4,
        "train.batch_size": 2,
        "data.seq_len": 48,
        "data.max_examples": 64,
        "output.dir": str(tmp_path / "run"),
        "train.device": "cpu",
        **over,
    }
    return load_recipe(QUICKSTART, [f"{k}={v}" for k, v in settings.items()])


def _train(cfg, resume=None):
    trainer = Trainer(cfg, quiet=True)
    trainer.setup(resume=resume)
    return trainer.train()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_the_records_numbers_under_train_and_eval():
    record = {"step": 3, "loss": 1.5, "lr": 1e-4, "eval_loss": 2.0, "epoch": 1, "note": "x", "flag": True}
    assert scalars(record) == {"train/loss": 1.5, "train/lr": 1e-4, "eval/loss": 2.0, "train/epoch": 1.0}


def test_tensorboard_events_hold_metrics_jsonl_and_a_resume_replaces_redone_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    over = {"output.tensorboard": "true", "output.checkpoint_every": 2}
    _train(_recipe(tmp_path, **over))
    run = tmp_path / "run"
    # Resumed from step 2 with another learning rate: steps 3 and 4 are redone with other losses.
    _train(_recipe(tmp_path, **over, **{"train.lr": 1e-2}), resume=run / "checkpoints" / "step_000002")
    records = _metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    events = _tensorboard_scalars(run / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"):
        got = events[f"train/{key}"]
        assert [step for step, _ in got] == [1, 2, 3, 4], key  # the first run's steps 3-4 are purged
        assert [v for _, v in got] == pytest.approx([r[key] for r in records], rel=1e-6), key


class _FakeWandb(types.ModuleType):
    """What a W&B run is asked for: init's arguments, and each log call."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_gets_every_record_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _recipe(tmp_path, **{"output.wandb": "harli-tests", "output.checkpoint_every": 2})
    _train(cfg)
    run = tmp_path / "run"
    first = fake.inits[0]
    assert first["project"] == "harli-tests" and first["name"] == "run" and first["dir"] == str(run)
    assert first["config"]["lora"]["rank"] == cfg.lora.rank and first["resume"] == "allow"
    records = _metrics(run)
    assert fake.logged == [(r["step"], scalars(r)) for r in records] and fake.finished == 1
    _train(_recipe(tmp_path, **{"output.wandb": "harli-tests", "train.steps": 6}), resume=run)
    assert fake.inits[1]["id"] == first["id"]  # the same W&B run continues
    assert [step for step, _ in fake.logged[len(records) :]] == [5, 6] and fake.finished == 2


def test_a_wandb_run_that_cannot_start_is_a_recipe_error(tmp_path, monkeypatch):
    fake = _FakeWandb()

    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    fake.init = refuse
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(RecipeError) as err:
        _train(_recipe(tmp_path, **{"output.wandb": "harli-tests"}))
    assert err.value.key == "output.wandb" and "wandb login" in str(err.value)
    assert "wandb.init failed: RuntimeError: api_key not configured (no-tty)" in err.value.found


@pytest.mark.parametrize(
    ("key", "value", "package", "found"),
    [
        ("output.wandb", "proj", "wandb", "'proj', but wandb is not installed"),
        ("output.tensorboard", "true", "torch.utils.tensorboard", "true, but tensorboard is not installed"),
    ],
)
def test_a_backend_that_is_not_installed_is_a_recipe_error_before_loading(
    tmp_path, monkeypatch, key, value, package, found
):
    real_import = builtins.__import__

    def no_backend(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_backend)
    monkeypatch.setattr("harli_train.train.trainer.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(RecipeError) as err:
        Trainer(_recipe(tmp_path, **{key: value}), quiet=True).setup()
    assert err.value.key == key and err.value.found == found
    assert f"pip install {package.rsplit('.', 1)[-1]}" in str(err.value)


def test_an_empty_wandb_project_is_refused():
    with pytest.raises(RecipeError, match="output.wandb: expected a string that is not empty"):
        load_recipe(QUICKSTART, ["output.wandb=''"])


def test_a_run_ends_with_loss_png_of_its_metrics(tmp_path):
    from click.testing import CliRunner

    settings = ["train.steps=3", "train.batch_size=2", "data.seq_len=48", f"output.dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(main, [str(QUICKSTART), "--quiet", *settings])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    plot = tmp_path / "run" / "loss.png"
    assert summary["loss_plot"] == str(plot)
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 300


def test_loss_png_plots_train_and_eval_loss_where_metrics_have_them(tmp_path, monkeypatch):
    import matplotlib.axes

    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5, "eval_loss": 2.8},
        {"step": 3, "loss": 2.0},
        {"step": 4, "loss": 1.5, "eval_loss": 2.1},
    ]
    metrics.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 5, "lo')  # a torn last line
    train, evals = read_losses(metrics)
    assert train == [(1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)] and evals == [(2, 2.8), (4, 2.1)]
    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, x, y, *args, **kwargs):
        drawn.append((list(x), list(y), kwargs["label"]))
        return real_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    assert plot_loss(metrics, tmp_path / "loss.png") == tmp_path / "loss.png"
    assert drawn == [([1, 2, 3, 4], [3.0, 2.5, 2.0, 1.5], "train loss"), ([2, 4], [2.8, 2.1], "eval loss")]
    assert (tmp_path / "loss.png").stat().st_size > 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_loss(empty, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
