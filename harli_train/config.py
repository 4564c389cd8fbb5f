"""Recipe configuration: a YAML recipe file (plus command-line overrides) turned into checked dataclasses.

Every key is declared once, as a dataclass field whose metadata holds its rule (kind, limit, optional:
`recipe_rules`); `__post_init__` applies the rules, so a section built in code is checked exactly like one
read from a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from harli_train.policy_names import (
    HARLI_OPTIONS,
    POLICIES,
    is_policy,
)
from harli_train.recipe_rules import (
    EXISTS,
    NOT_EMPTY,
    OVERRIDE_SOURCE,
    UNPLACED,
    Limit,
    Mismatch,
    RecipeError,
    Rule,
    above,
    among,
    at_least,
    describe,
    did_you_mean,
    key,
    register_kind,
    validate,
    within,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_GROUPS = {"all": PROJECTIONS, "attention": PROJECTIONS[:4], "mlp": PROJECTIONS[4:]}


def _as_targets(v: Any) -> list[str]:
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise Mismatch()
    chosen: set[str] = set()
    for name in names:
        if name not in PROJECTIONS and name not in TARGET_GROUPS:
            raise Mismatch(f"unknown {name!r}{did_you_mean(name, [*PROJECTIONS, *TARGET_GROUPS])}")
        chosen.update(TARGET_GROUPS.get(name, (name,)))
    return [p for p in PROJECTIONS if p in chosen]  # canonical order, no duplicates


register_kind(
    "targets", f"a list of projections among {', '.join([*PROJECTIONS, *TARGET_GROUPS])}", _as_targets
)


_BETAS = Limit("with both in [0, 1)", lambda pair: all(0 <= b < 1 for b in pair))


_POLICY = Limit(
    f"among {', '.join(POLICIES)}, exclusive:N, static:N (N = 1..1024), {HARLI_OPTIONS}", is_policy
)


LADDER_STEPS = tuple(range(8, 65, 8))  # green contexts come in 8-SM groups
_LADDER_STEP = Limit(
    "that is a multiple of 8 in [8, 64] (green contexts come in 8-SM groups)", LADDER_STEPS.__contains__
)


@dataclass(slots=True)
class ModelSection:
    """Which base model: a preset name (harli_train/model/config.py PRESETS) or a local Hugging Face folder.
    dtype `auto` means bfloat16 on a GPU, float32 on the CPU."""

    name: str = key("tiny", "str")
    dtype: str = key("auto", "str", among("auto", "float32", "bfloat16", "float16"))
    seed: int = key(0, "int", at_least(0))  # seed of a preset's random weights

    def __post_init__(self) -> None:
        validate(self, "model")


@dataclass(slots=True)
class LoraSection:
    """Adapter shape and the projections it is attached to."""

    rank: int = key(8, "int", above(0))
    alpha: float = key(16.0, "float", above(0))
    dropout: float = key(0.0, "float", within(0, 1, open_top=True))
    targets: list[str] = key(list(PROJECTIONS), "targets")

    def __post_init__(self) -> None:
        validate(self, "lora")


DATA_FORMATS = ("auto", "prompt_completion", "text", "chat", "alpaca", "sharegpt")


@dataclass(slots=True)
class DataSection:
    """Training data: a file or folder, how to read it and how to cut it into sequences; and the validation
    data, a file or folder of its own (`val_path`)
    or a seeded fraction held out of `path` (`val_fraction`)."""

    path: str = key(MISSING, "path", EXISTS)
    format: str = key("auto", "str", among(*DATA_FORMATS))
    train_on: str = key("assistant", "str", among("assistant", "all"))
    seq_len: int = key(512, "int", at_least(2))
    packing: bool = key(True, "bool")
    shuffle: bool = key(True, "bool")
    max_examples: int | None = key(None, "int", above(0), optional=True)
    val_path: str | None = key(None, "path", EXISTS, optional=True)
    val_fraction: float | None = key(None, "float", Limit("in (0, 1)", lambda v: 0 < v < 1), optional=True)

    def __post_init__(self) -> None:
        validate(self, "data")
        if self.val_path is not None and self.val_fraction is not None:
            found = f"both (val_path={self.val_path}, val_fraction={self.val_fraction})"
            raise RecipeError(
                UNPLACED, "data.val_fraction", "at most one of data.val_path and data.val_fraction", found
            )


@dataclass(slots=True)
class TrainSection:
    """Optimiser, schedule and step budget; exactly one of `steps` and `epochs` is set. A `warmup_steps` that
    is not below the run's step count is clamped to one less by the trainer (which knows the count)."""

    batch_size: int = key(8, "int", above(0))
    grad_accum: int = key(1, "int", above(0))
    steps: int | None = key(None, "int", above(0), optional=True)
    epochs: float | None = key(None, "float", above(0), optional=True)
    lr: float = key(2e-4, "float", above(0))
    schedule: str = key("cosine", "str", among("cosine", "linear", "constant"))
    warmup_steps: int = key(0, "int", at_least(0))
    min_lr_ratio: float = key(0.0, "float", within(0, 1))
    weight_decay: float = key(0.0, "float", at_least(0))
    betas: tuple[float, float] = key((0.9, 0.999), "pair", _BETAS)
    eps: float = key(1e-8, "float", above(0))
    clip_grad_norm: float | None = key(1.0, "float", at_least(0), optional=True)  # 0 or null: no clipping
    seed: int = key(0, "int", at_least(0))
    layers_per_microstep: int = key(1, "int", at_least(1))
    # Each micro-step replayed as one CUDA graph, captured once (harli_train/train/step_graphs.py). Needs
    # lora.dropout 0; a co-located run then keeps its KV cache out of the page pool (colocation.memory_pool).
    cuda_graphs: bool = key(False, "bool")
    kernels: str = key("auto", "str", among("auto", "triton", "torch"))
    device: str = key("auto", "str", among("auto", "cpu", "cuda"))
    log_every: int = key(10, "int", at_least(1))
    eval_every: int = key(0, "int", at_least(0))  # 0: only at the end (with validation data)

    def __post_init__(self) -> None:
        validate(self, "train")
        if (self.steps is None) == (self.epochs is None):
            found = "neither" if self.steps is None else f"both (steps={self.steps}, epochs={self.epochs})"
            raise RecipeError(UNPLACED, "train.steps", "exactly one of train.steps and train.epochs", found)
        if self.clip_grad_norm == 0:
            self.clip_grad_norm = None


DEFAULT_OUTPUT_DIR = "runs/{recipe_stem}"


def resolve_output_dir(template: str, source: str) -> str:
    """``template`` with ``{recipe_stem}`` replaced by the stem of recipe file ``source``, made absolute
    (relative to the working directory)."""
    return str(Path(template.replace("{recipe_stem}", Path(source).stem)).expanduser().resolve())


@dataclass(slots=True)
class OutputSection:
    """Where checkpoints go; `{recipe_stem}` in `dir` is replaced by the recipe file's stem. A new run into a
    `dir` that holds another run's checkpoints is refused unless `overwrite` (which deletes them). Beside
    metrics.jsonl, `tensorboard` writes event files under `dir/tensorboard/` and `wandb` logs to that W&B
    project (harli_train/train/log_sinks.py)."""

    dir: str = key(DEFAULT_OUTPUT_DIR, "str")
    checkpoint_every: int = key(0, "int", at_least(0))  # 0: only at exit
    keep_checkpoints: int = key(2, "int", at_least(1))
    overwrite: bool = key(False, "bool")
    tensorboard: bool = key(False, "bool")
    wandb: str | None = key(None, "str", NOT_EMPTY, optional=True)  # a W&B project name

    def __post_init__(self) -> None:
        validate(self, "output")


# Fraction of the TPOT objective kept free of predicted decode time: room for what the prediction does not see
# (host delays, GPU noise). Why 0.15: docs/design.md, "Measured facts behind the defaults".
DEFAULT_MARGIN = 0.15


@dataclass(slots=True)
class ColocationSection:
    """Sharing the GPU with decode: the SM policy, the TPOT objective and the request load."""

    policy: str = key("harli", "str", _POLICY)
    tpot_ms: float = key(50.0, "float", above(0))
    # A time-to-first-token objective: a backlog of prompts is computed on the whole GPU at the TPOT budget in
    # time for each to have waited at most this long less the margin, past the budget only for a prompt that
    # cannot be reached in time (Policy.ttft_plan; None: the TPOT budget alone sizes prefill).
    ttft_ms: float | None = key(None, "float", above(0), optional=True)
    margin: float = key(DEFAULT_MARGIN, "float", within(0, 0.9))
    trace: str | None = key(None, "path", EXISTS, optional=True)
    rate: float | None = key(None, "float", at_least(0), optional=True)  # requests/s; 0: no synthetic load
    duration_s: float = key(60.0, "float", above(0))
    prompt_len: int = key(512, "int", at_least(1))
    output_len: int = key(128, "int", at_least(1))
    max_batch: int = key(64, "int", at_least(1))
    profile: str | None = key(None, "path", optional=True)
    # SMs between the ladder's rungs: 8 gives finer shares, 16 fewer switches (docs/design.md, "Measured facts
    # behind the defaults").
    ladder_step: int = key(16, "int", _LADDER_STEP)
    # true: prefill chunks ride in decode steps (stall-free, replayed as CUDA graphs on a GPU); false: prefill
    # steps of their own, which stall decoding (the A/B: docs/design.md has both on the H200).
    mixed_prefill: bool = key(True, "bool")
    # true: each step's successor (decode or mixed) is launched before the step's tokens are read back, so
    # the GPU goes from one step to the next without waiting for the host's bookkeeping, planning and
    # staging; the policy's plan then places the step launched in its call (ColocatedRuntime._step).
    # Under tensor parallelism no step runs ahead (the key is then taken as false).
    launch_ahead: bool = key(True, "bool")
    max_queue: int = key(256, "int", at_least(1))  # with --serve: requests waiting at most (more get 429)
    # With --serve: the adapter being trained is served as model id <output dir name>, refreshed from the
    # trainer's masters every this many optimizer steps.
    serve_adapter_every: int = key(1, "int", at_least(1))
    # One page pool for the KV cache and the trainer (harli_train/colocate/pool_memory.py); false: a fixed KV
    # tensor and torch's allocator, as without the pool (the A/B). memory_gib: the pool's budget (default:
    # what is free after the weights, less a safety margin); trainer_memory_gib: the trainer's quota in it;
    # spill_host_gib: pinned host memory made at set-up for the trainer's spills on a GPU (default: what its
    # stashes and the pool can hold, at most an eighth of the host's memory; 0: pinned as spills need it).
    memory_pool: bool = key(True, "bool")
    # KV room kept for every running request's next this many tokens: a prompt is admitted only when that room
    # stays free, and the pooled cache grows that far ahead, so that running requests need no preemption
    # while a grow waits for the trainer's pages (EngineConfig.decode_reserve_tokens). 0: admit while a
    # prompt fits; the A/B under pressure is bench/bench_pool.py's loss phase.
    decode_reserve_tokens: int = key(0, "int", at_least(0))
    memory_gib: float | None = key(None, "float", above(0), optional=True)
    trainer_memory_gib: float | None = key(None, "float", above(0), optional=True)
    spill_host_gib: float | None = key(None, "float", at_least(0), optional=True)

    def __post_init__(self) -> None:
        validate(self, "colocation")
        if (
            self.memory_gib is not None
            and self.trainer_memory_gib is not None
            and self.trainer_memory_gib > self.memory_gib
        ):
            raise RecipeError(
                UNPLACED,
                "colocation.trainer_memory_gib",
                f"a quota within the pool's budget (colocation.memory_gib = {self.memory_gib:g})",
                f"{self.trainer_memory_gib:g}",
            )

    @property
    def static_sms(self) -> int | None:
        """The SM count of a `static:N` policy, else None."""
        return int(self.policy.split(":")[1]) if self.policy.startswith("static:") else None


SECTIONS: dict[str, type] = dict(
    model=ModelSection,
    lora=LoraSection,
    data=DataSection,
    train=TrainSection,
    output=OutputSection,
    colocation=ColocationSection,
)


@dataclass(slots=True)
class RecipeConfig:
    """A whole recipe; `source` is the recipe file it came from."""

    model: ModelSection
    lora: LoraSection
    data: DataSection
    train: TrainSection
    output: OutputSection
    colocation: ColocationSection
    source: str = ""

    def __post_init__(self) -> None:
        self.output.dir = resolve_output_dir(self.output.dir, self.source)


def _check_key(section: str, name: str | None, where: str) -> None:
    if section not in SECTIONS:
        unknown = f"unknown {section!r}{did_you_mean(section, list(SECTIONS))}"
        raise RecipeError(where, section, f"a section among {', '.join(SECTIONS)}", unknown)
    valid = [f.name for f in fields(SECTIONS[section])]
    if name is not None and name not in valid:
        unknown = f"unknown {name!r}{did_you_mean(name, valid)}"
        raise RecipeError(where, f"{section}.{name}", f"a key among {', '.join(valid)}", unknown)


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Parse `section.key=value` strings (values: YAML scalars or flow sequences) into {dotted key: value}."""
    parsed: dict[str, Any] = {}
    for text in overrides:
        dotted, eq, raw = text.partition("=")
        section, dot, name = dotted.strip().partition(".")
        if not eq or not dot or not name or "." in name:
            raise RecipeError(OVERRIDE_SOURCE, "", "section.key=value (e.g. train.lr=3e-4)", repr(text))
        _check_key(section, name, OVERRIDE_SOURCE)
        try:
            parsed[f"{section}.{name}"] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise RecipeError(OVERRIDE_SOURCE, dotted, "a YAML value", repr(raw)) from None
    return parsed


def _read_yaml(path: Path) -> dict[str, dict[str, Any]]:
    where = str(path)
    if not path.is_file():
        raise RecipeError(where, "", "a YAML recipe file", f"nothing at {path.resolve()}")
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(where, "", "a readable UTF-8 text file", f"{type(e).__name__}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, problem = (f"line {mark.line + 1}" if mark else ""), getattr(e, "problem", None) or e
        raise RecipeError(where, line, "valid YAML", f"a syntax error: {problem}") from None
    tree = {} if tree is None else tree
    if not isinstance(tree, dict):
        raise RecipeError(where, "", f"a mapping of sections ({', '.join(SECTIONS)})", describe(tree))
    for section, body in tree.items():
        _check_key(str(section), None, where)
        if body is not None and not isinstance(body, dict):
            raise RecipeError(where, str(section), "a mapping of keys", describe(body))
        for name in body or {}:
            _check_key(section, str(name), where)
    return {section: dict(body or {}) for section, body in tree.items()}


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read a recipe file, apply `section.key=value` overrides, and return the checked RecipeConfig.

    Overrides apply before any value is checked, so an override can fix a bad value in the file.
    Relative paths in the file resolve against the file's folder; in overrides, against the working folder.
    """
    path = Path(path)
    where = str(path)
    tree = _read_yaml(path)
    origin: dict[str, str] = {}
    for dotted, value in parse_overrides(overrides).items():
        section, name = dotted.split(".")
        tree.setdefault(section, {})[name] = value
        origin[dotted] = OVERRIDE_SOURCE
    sections: dict[str, Any] = {}
    try:
        for section, cls in SECTIONS.items():
            values = tree.get(section, {})
            for f in fields(cls):
                dotted, value = f"{section}.{f.name}", values.get(f.name)
                rule: Rule = f.metadata["rule"]
                if f.default is MISSING and f.default_factory is MISSING and f.name not in values:
                    raise RecipeError(UNPLACED, dotted, rule.expectation(), "nothing (the key is required)")
                if rule.kind == "path" and isinstance(value, str) and dotted not in origin:
                    values[f.name] = str(path.parent / Path(value).expanduser())  # absolute stays absolute
            sections[section] = cls(**values)
    except RecipeError as e:
        raise RecipeError(origin.get(e.key, where), e.key, e.expected, e.found) from None
    return RecipeConfig(**sections, source=str(path.resolve()))


def recipe_to_dict(cfg: RecipeConfig) -> dict[str, dict[str, Any]]:
    """Every key as plain data (paths resolved, tuples as lists): `yaml.safe_dump` of it loads back equal."""
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        values = {f.name: getattr(section, f.name) for f in fields(section)}
        out[name] = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}
    return out
