"""Helpers of the co-located runtime's tests: the small quickstart recipe and its load, a runtime over the
tiny model on a CPU ladder, scripted and synthetic policies and predictors, and readers of a run's outputs."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from harli_train.colocate.assembly import build_engine
from harli_train.colocate.policy import BESIDE, Policy, StepPlan
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.runtime import ColocatedRuntime
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.shared_model import base_view
from harli_train.colocate.sm import SMLadder
from harli_train.config import load_recipe
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine.load import TraceRequest
from harli_train.engine.step_work import PrefillPiece, StepPreview
from harli_train.model import load_model
from harli_train.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SMALL = [
    "train.steps=6",
    "train.batch_size=2",
    "data.seq_len=32",
    "train.layers_per_microstep=2",
    "train.warmup_steps=1",
    "train.log_every=100",
    "output.checkpoint_every=0",
]
LOAD = [
    "colocation.rate=20",
    "colocation.duration_s=1.0",
    "colocation.prompt_len=16",
    "colocation.output_len=8",
    "colocation.max_batch=8",
    "colocation.tpot_ms=50",
]


def preview(
    kind: str, batch: int = 0, kv_tokens: int = 0, after: tuple[int, int] | None = None
) -> StepPreview:
    """A StepPreview of a decode step (``batch`` rows over ``kv_tokens``), or of a pure prefill step whose
    prompts make the decode step after it ``after`` = (sequences, KV tokens)."""
    if kind == "decode":
        return StepPreview(batch, kv_tokens)
    b, kv = after or (1, kv_tokens or 2)
    sizes = [kv // b - 1] * b
    sizes[0] += kv - sum(n + 1 for n in sizes)
    return StepPreview(0, 0, tuple(PrefillPiece(n, 0, 0) for n in sizes))


TOTAL = 132


def recipe(out: Path, *extra: str):
    return load_recipe(QUICKSTART, [*SMALL, *LOAD, f"output.dir={out}", *extra])


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def synthetic_predictor(shares, per_seq_s=2e-3):
    """1 ms * (1 + 64/s) + per_seq_s per sequence alone, +25 % beside the trainer; no online correction."""
    params = {s: [1e-3 * (1 + 64 / s), 0.0, 0.25] for s in shares}
    pred = LatencyPredictor(TOTAL, 1.0, list(shares), params, [0.0, 0.0, 0.0, per_seq_s], [0.0, 0.0], 256)
    pred.alpha = 0.0  # measured CPU latencies must not move these test predictions
    return pred


def requests(spec):
    """[(arrival_s, count, output_len)] -> trace requests of 16-token prompts."""
    out = []
    for arrival, count, output_len in spec:
        out += [
            TraceRequest(arrival, output_len, prompt_len=16, request_id=str(len(out) + i))
            for i in range(count)
        ]
    return out


def runtime(out: Path, ladder, make_policy_fn, load, options: RuntimeOptions, spy=None, hook=None, *extra):
    """A runtime over the tiny model with shared weights, the given ladder, policy and load."""
    cfg = recipe(out, *extra)
    trainer = Trainer(cfg, model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    if spy is not None:
        original = trainer.micro_steps
        trainer.micro_steps = lambda: spy(trainer, original())
    engine = build_engine(
        base_view(trainer.model),
        load_tokenizer("tiny", True),
        ladder,
        load,
        16,
        mixed_prefill=cfg.colocation.mixed_prefill,
    )
    return ColocatedRuntime(trainer, engine, make_policy_fn(ladder), load, out / "colocate", options, hook)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "colocate" / "steps.jsonl").read_text().splitlines()]


class ScriptedPolicy(Policy):
    """Decode on a scripted share per decision; one trainer micro-step per decision."""

    name = "scripted"

    def __init__(self, ladder, script, transient=lambda: False):
        super().__init__(ladder, 0.05, 0.1)
        self.script, self.transient = script, transient

    def partitions(self):
        return list(self.ladder.partitions)

    def plan(self, preview):
        part = self.ladder.select(self.script())
        return StepPlan(
            part,
            BESIDE,
            part.train_stream,
            part.train_sms,
            1e-9,
            None,
            "scripted",
            isolated=True,
            train_from_sm=part.infer_sms,
            strict=False,
            transient=self.transient(),
        )


def graphed_runtime(out: Path, script, arena: bool = True) -> ColocatedRuntime:
    """A runtime on ``train.cuda_graphs`` under ScriptedPolicy(``script``): decode's share per decision;
    ``arena=False``: its graphs without the saved-tensor arena."""
    rt = runtime(
        out,
        SMLadder.cpu_standin(TOTAL, 8),
        lambda ladder: ScriptedPolicy(ladder, script),
        requests([(0.0, 4, 400)]),
        RuntimeOptions(quiet=True, plots=False),
        None,
        None,
        "train.cuda_graphs=true",
    )
    assert not rt.trainer.graphs.shapes  # no graphs made yet: the arena is still to choose
    rt.trainer.graphs.arena = arena
    return rt
