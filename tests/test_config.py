"""Recipe loading: values, defaults, overrides, and one error per kind of mistake that names file, key and
expectation."""

from pathlib import Path

import pytest
import yaml

from harli_train.config import (
    PROJECTIONS,
    DataSection,
    RecipeError,
    TrainSection,
    load_recipe,
    parse_overrides,
    recipe_to_dict,
)

FULL = """\
model: {name: llama-1b, dtype: bfloat16, seed: 3}
lora: {rank: 16, alpha: 32, dropout: 0.05, targets: [v_proj, q_proj, q_proj]}
data: {path: data/train.jsonl, format: prompt_completion, seq_len: 1024, packing: false, max_examples: 100}
train:
  batch_size: 4
  grad_accum: 2
  steps: 200
  lr: 1e-4            # no dot: PyYAML reads this as a string
  schedule: linear
  warmup_steps: 20
  min_lr_ratio: 0.1
  betas: [0.9, 0.95]
  clip_grad_norm: 0
  layers_per_microstep: 4
  kernels: torch
  device: cpu
output: {dir: "out/{recipe_stem}", checkpoint_every: 50, keep_checkpoints: 3}
colocation:
  {policy: "static:64", tpot_ms: 30, margin: 0.2, trace: data/trace.jsonl, rate: 4, profile: prof.json}
"""
MINIMAL = "data: {path: data/train.jsonl}\ntrain: {steps: 10}\n"


def write_recipe(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "data" / "trace.jsonl").write_text("")
    path = tmp_path / name
    path.write_text(text)
    return path


def recipe_with(tmp_path: Path, dotted: str, value: object) -> Path:
    """MINIMAL with one key set to `value` (written by PyYAML, so strings stay strings)."""
    tree = yaml.safe_load(MINIMAL)
    section, name = dotted.split(".")
    tree.setdefault(section, {})[name] = value
    return write_recipe(tmp_path, yaml.safe_dump(tree))


def load_error(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_full_recipe_loads_values_and_resolves_paths(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # output.dir follows the working folder, data paths the recipe's
    cfg = load_recipe(write_recipe(tmp_path, FULL))
    assert (cfg.model.name, cfg.model.dtype, cfg.model.seed) == ("llama-1b", "bfloat16", 3)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (16, 32.0, 0.05)
    assert cfg.lora.targets == ["q_proj", "v_proj"]  # canonical order, duplicate dropped
    assert cfg.data.path == str((tmp_path / "data" / "train.jsonl").resolve())
    assert (cfg.data.format, cfg.data.seq_len) == ("prompt_completion", 1024)
    assert (cfg.data.packing, cfg.data.shuffle, cfg.data.max_examples) == (False, True, 100)
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert (cfg.train.steps, cfg.train.epochs, cfg.train.warmup_steps) == (200, None, 20)
    assert cfg.train.betas == (0.9, 0.95) and cfg.train.clip_grad_norm is None
    assert (cfg.train.schedule, cfg.train.kernels, cfg.train.device) == ("linear", "torch", "cpu")
    assert cfg.output.dir == str((tmp_path / "cwd" / "out" / "recipe").resolve())
    assert cfg.output.keep_checkpoints == 3
    assert cfg.colocation.policy == "static:64" and cfg.colocation.static_sms == 64
    assert cfg.colocation.trace == str((tmp_path / "data" / "trace.jsonl").resolve())
    assert cfg.colocation.profile == str((tmp_path / "prof.json").resolve())  # need not exist yet
    assert cfg.source == str((tmp_path / "recipe.yaml").resolve())


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe(write_recipe(tmp_path, MINIMAL, name="mini.yaml"))
    assert (cfg.model.name, cfg.model.dtype) == ("tiny", "auto")
    assert cfg.lora.targets == list(PROJECTIONS) and cfg.lora.rank == 8
    assert (cfg.data.format, cfg.data.seq_len, cfg.data.packing) == ("auto", 512, True)
    assert (cfg.train.batch_size, cfg.train.lr, cfg.train.schedule) == (8, 2e-4, "cosine")
    assert cfg.train.betas == (0.9, 0.999) and cfg.train.clip_grad_norm == 1.0
    assert cfg.output.dir == str(tmp_path.resolve() / "runs" / "mini")
    assert (cfg.colocation.policy, cfg.colocation.static_sms, cfg.colocation.trace) == ("harli", None, None)
    assert cfg.colocation.ladder_step == 16


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("all", list(PROJECTIONS)),
        ("attention", list(PROJECTIONS[:4])),
        ("[mlp, q_proj]", ["q_proj", *PROJECTIONS[4:]]),
    ],
)
def test_target_groups(tmp_path, value, expected):
    cfg = load_recipe(write_recipe(tmp_path, MINIMAL), [f"lora.targets={value}"])
    assert cfg.lora.targets == expected


def test_overrides_of_scalars_and_lists(tmp_path):
    path = write_recipe(tmp_path, FULL)
    overrides = ["train.lr=3e-4", "lora.targets=[q_proj,v_proj,o_proj]", "data.packing=true"]
    cfg = load_recipe(path, [*overrides, "train.steps=", "train.epochs=2", "colocation.policy=temporal"])
    assert cfg.train.lr == 3e-4 and cfg.lora.targets == ["q_proj", "v_proj", "o_proj"]
    assert cfg.data.packing is True and (cfg.train.steps, cfg.train.epochs) == (None, 2.0)
    assert cfg.colocation.policy == "temporal"
    parsed = parse_overrides(["train.betas=[0.8, 0.9]", "model.name = llama-8b", "train.steps=null"])
    assert parsed == {"train.betas": [0.8, 0.9], "model.name": "llama-8b", "train.steps": None}


def test_override_paths_resolve_against_working_folder(tmp_path, monkeypatch):
    path = write_recipe(tmp_path, MINIMAL)
    monkeypatch.chdir(tmp_path / "data")
    cfg = load_recipe(path, ["data.path=trace.jsonl"])
    assert cfg.data.path == str((tmp_path / "data" / "trace.jsonl").resolve())


def test_override_fixes_a_bad_file_value(tmp_path):
    path = write_recipe(tmp_path, MINIMAL + "lora: {rank: 0}\n")
    assert load_recipe(path, ["lora.rank=4"]).lora.rank == 4


def test_round_trip_through_dict(tmp_path):
    cfg = load_recipe(write_recipe(tmp_path, FULL))
    saved = tmp_path / "elsewhere" / "saved.yaml"
    saved.parent.mkdir()
    saved.write_text(yaml.safe_dump(recipe_to_dict(cfg)))
    again = load_recipe(saved)
    assert recipe_to_dict(again) == recipe_to_dict(cfg)
    assert again.train == cfg.train and again.data == cfg.data and again.output == cfg.output


def test_sections_built_in_code_are_checked(tmp_path):
    with pytest.raises(RecipeError, match=r"train\.batch_size: expected an integer > 0, got 0"):
        TrainSection(batch_size=0, steps=5)
    data = tmp_path / "d.txt"
    data.write_text("x")
    assert DataSection(path=str(data), seq_len=2).path == str(data.resolve())


# One test per kind of mistake: each message names the file (or command line), the key, the expectation.
def test_missing_file(tmp_path):
    assert_names(load_error(tmp_path / "nope.yaml"), "nope.yaml", "expected a YAML recipe file", "nothing at")


def test_yaml_syntax_error_gives_line(tmp_path):
    message = load_error(write_recipe(tmp_path, "train:\n  lr: 1\n  steps: [1, 2\n"))
    assert_names(message, "recipe.yaml", "line 4", "expected valid YAML")


def test_top_level_not_a_mapping(tmp_path):
    message = load_error(write_recipe(tmp_path, "- model\n- train\n"))
    assert_names(message, "recipe.yaml", "expected a mapping of sections", "got list")


def test_section_not_a_mapping(tmp_path):
    message = load_error(write_recipe(tmp_path, MINIMAL + "model: tiny\n"))
    assert_names(message, "recipe.yaml", "model:", "expected a mapping of keys", "got str 'tiny'")


def test_unknown_section(tmp_path):
    message = load_error(write_recipe(tmp_path, MINIMAL + "trian: {lr: 1}\n"))
    assert_names(message, "recipe.yaml", "trian", "expected a section among model", "did you mean 'train'?")


def test_unknown_key_suggests_closest(tmp_path):
    message = load_error(recipe_with(tmp_path, "train.lrr", 1))
    assert_names(message, "recipe.yaml", "train.lrr", "expected a key among batch_size", "did you mean 'lr'?")


@pytest.mark.parametrize(
    ("key", "value", "expected", "found"),
    [
        ("train.lr", "fast", "expected a number > 0", "got str 'fast'"),
        ("train.batch_size", 2.5, "expected an integer > 0", "got float 2.5"),
        ("train.steps", True, "expected an integer > 0 or null", "got bool True"),
        ("data.packing", 1, "expected true or false", "got int 1"),
        ("model.name", None, "expected a string", "got null"),
        ("lora.targets", ["q_proj", "qq_proj"], "expected a list of projections", "unknown 'qq_proj'"),
        ("train.betas", [0.9], "expected a pair of numbers", "got list [0.9]"),
    ],
)
def test_wrong_type(tmp_path, key, value, expected, found):
    assert_names(load_error(recipe_with(tmp_path, key, value)), "recipe.yaml", key, expected, found)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("lora.rank", 0, "expected an integer > 0, got 0"),
        ("train.lr", -1e-3, "expected a number > 0, got -0.001"),
        ("data.seq_len", 1, "expected an integer >= 2, got 1"),
        ("lora.dropout", 1, "expected a number in [0, 1), got 1.0"),
        ("train.batch_size", -2, "expected an integer > 0, got -2"),
        ("colocation.margin", 0.95, "expected a number in [0, 0.9], got 0.95"),
        ("colocation.tpot_ms", 0, "expected a number > 0, got 0.0"),
        ("colocation.ladder_step", 12, "expected an integer that is a multiple of 8 in [8, 64]"),
        ("output.keep_checkpoints", 0, "expected an integer >= 1, got 0"),
        ("train.schedule", "cos", "expected a string among cosine, linear, constant, got 'cos'"),
        ("train.betas", [0.9, 1.0], "expected a pair of numbers with both in [0, 1), got (0.9, 1.0)"),
        (
            "data.format",
            "csv",
            "expected a string among auto, prompt_completion, text, chat, alpaca, sharegpt",
        ),
        ("data.train_on", "completion", "expected a string among assistant, all, got 'completion'"),
    ],
)
def test_impossible_value(tmp_path, key, value, expected):
    assert_names(load_error(recipe_with(tmp_path, key, value)), "recipe.yaml", key, expected)


def test_the_recipe_knows_every_data_format_the_reader_does():
    from harli_train.config import DATA_FORMATS
    from harli_train.data.formats import FORMATS

    assert DATA_FORMATS == FORMATS


@pytest.mark.parametrize(
    ("override", "found"),
    [
        ("train.lr=inf", "got str 'inf' (not a finite number)"),
        ("train.lr=.inf", "got float inf (not a finite number)"),
        ("lora.alpha=nan", "got str 'nan' (not a finite number)"),
        ("train.eps=-.inf", "got float -inf (not a finite number)"),
        ("colocation.tpot_ms=1e999", "got str '1e999' (not a finite number)"),
        ("train.epochs=.nan", "got float nan (not a finite number)"),
        ("train.betas=[0.9, .nan]", "got list [0.9, nan] (not a finite number)"),
    ],
)
def test_non_finite_numbers_are_refused(tmp_path, override, found):
    # Every `> 0` or range test passes inf (and every comparison with nan is False): reject them by kind.
    key = override.partition("=")[0]
    message = load_error(write_recipe(tmp_path, MINIMAL), (override,))
    assert_names(message, "command line override", key, found)


def test_value_from_override_names_the_command_line(tmp_path):
    message = load_error(write_recipe(tmp_path, MINIMAL), ("train.lr=0",))
    assert_names(message, "command line override", "train.lr", "expected a number > 0, got 0.0")


@pytest.mark.parametrize(
    ("train", "found"),
    [("{lr: 1.0}", "got neither"), ("{steps: 10, epochs: 1}", "got both (steps=10, epochs=1.0)")],
)
def test_steps_and_epochs_exactly_one(tmp_path, train, found):
    message = load_error(write_recipe(tmp_path, f"data: {{path: data/train.jsonl}}\ntrain: {train}\n"))
    assert_names(message, "recipe.yaml", "train.steps", "exactly one of train.steps and train.epochs", found)


def test_missing_data_path(tmp_path):
    message = load_error(write_recipe(tmp_path, "train: {steps: 10}\n"))
    assert_names(message, "recipe.yaml", "data.path", "expected a path that exists", "required")


def test_data_path_that_does_not_exist(tmp_path):
    message = load_error(write_recipe(tmp_path, "data: {path: data/missing.jsonl}\ntrain: {steps: 10}\n"))
    assert_names(message, "recipe.yaml", "data.path", "expected a path that exists", "missing.jsonl")


def test_bad_override_syntax(tmp_path):
    message = load_error(write_recipe(tmp_path, MINIMAL), ("train.lr",))
    assert_names(message, "command line override", "expected section.key=value", "'train.lr'")


def test_override_of_unknown_key(tmp_path):
    message = load_error(write_recipe(tmp_path, MINIMAL), ("train.lrr=1",))
    assert_names(message, "command line override", "train.lrr", "expected a key among", "did you mean 'lr'?")


@pytest.mark.parametrize(
    "policy",
    [
        "static",
        "static:0",
        "static:2000",
        "static:x",
        "static:N",
        "exclusive:0",
        "exclusive:",
        "harly",
        "harli:",
        "harli:grow=0.9",
        "harli:ahead=1",
        "harli:stride=0",
        "harli:window=11",
        "harli:window=-0.1",
        "harli:window=",
    ],
)
def test_bad_policy(tmp_path, policy):
    message = load_error(recipe_with(tmp_path, "colocation.policy", policy))
    assert_names(message, "recipe.yaml", "colocation.policy", "among harli, streams", "static:N (N = 1..")


@pytest.mark.parametrize(
    "policy",
    [
        "harli:prefill=beside",
        "harli:grow=0.05",
        "harli:grow=0.1,prefill=paused",
        "harli:ahead=on,grow=0",
        "harli:settle=on,margin=learn",
        "harli:margin=fixed",
        "harli:stride=1",
        "harli:backward=on",
        "harli:floor=64",
        "harli:floor=match,floor=96",
        "harli:window=0.1",
        "harli:window=0",
        "exclusive:48",
    ],
)
def test_harli_variants_and_exclusive_splits_are_policies(tmp_path, policy):
    assert load_recipe(recipe_with(tmp_path, "colocation.policy", policy)).colocation.policy == policy


def test_harli_settle_and_learnt_margin_reach_the_controller():
    from harli_train.colocate.policy import make_policy
    from harli_train.colocate.sm import SMLadder

    from .runtime_support import synthetic_predictor

    ladder = SMLadder.cpu_standin(132, 16)
    policy = make_policy("harli:margin=fixed,settle=on", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert policy.name == "harli:settle=on,margin=fixed"  # canonical order
    assert policy.controller.settle and policy.controller.learned_margin is None
    default = make_policy("harli", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert not default.controller.settle and default.controller.learned_margin is not None  # margin=learn
    assert make_policy("harli:margin=learn", ladder, synthetic_predictor(ladder.shares), 0.05).name == "harli"


def test_harli_stride_picks_the_trainers_rungs():
    from harli_train.colocate.policy import make_policy
    from harli_train.colocate.sm import SMLadder

    from .runtime_support import synthetic_predictor

    ladder = SMLadder.cpu_standin(132, 16)
    other = make_policy("harli:stride=2", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert other.name == "harli:stride=2" and len(other.trainer_rungs) == -(-len(ladder.spatial) // 2)
    default = make_policy("harli", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert default.name == "harli" and default.trainer_rungs == ladder.spatial
    assert make_policy("harli:stride=1", ladder, synthetic_predictor(ladder.shares), 0.05).name == "harli"


def test_harli_window_is_how_long_the_trainer_trails_decodes_peak():
    from harli_train.colocate.policy import make_policy
    from harli_train.colocate.sm import SMLadder

    from .runtime_support import synthetic_predictor

    ladder = SMLadder.cpu_standin(132, 16)
    short = make_policy("harli:window=0.05", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert short.name == "harli:window=0.05" and short.rungs.window_s == 0.05
    default = make_policy("harli:window=0.3", ladder, synthetic_predictor(ladder.shares), 0.05)
    assert default.name == "harli" and default.rungs.window_s == 0.3
