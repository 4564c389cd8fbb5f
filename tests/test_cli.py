"""The command line's verbs: help and version, profile, serve-trace; the exit code of each kind of error."""

import errno
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from harli_train import __version__
from harli_train.adapter import AdapterError
from harli_train.cli import main
from harli_train.colocate.profile import ProfileError
from harli_train.config import RecipeError
from harli_train.data.example import DataError
from harli_train.engine.engine import RequestRefused
from harli_train.engine.engine_config import EngineError
from harli_train.engine.load import TraceError
from harli_train.engine.sequence import Sequence
from harli_train.model import ModelError
from harli_train.train.checkpoint import CheckpointError
from harli_train.train.divergence import TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_verb_and_version():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for verb in ("train", "generate", "serve-trace", "profile", "export", "convert-gguf"):
        assert verb in result.output
    assert "RECIPE.yaml" in result.output
    assert __version__ in CliRunner().invoke(main, ["--version"]).output
    train_help = CliRunner().invoke(main, ["train", "--help"]).output
    for option in ("--colocate-with", "--policy", "--resume", "--resume-from", "--quiet"):
        assert option in train_help


def test_top_level_help_shows_the_main_form_options():
    # `harli-train --help` is where a user looks for --colocate-with and --resume: they are the main form's.
    text = CliRunner().invoke(main, ["--help"]).output
    section = text.split("Main form options (harli-train RECIPE.yaml [OPTIONS] [key.sub=value ...]):\n")[1]
    for option in ("--colocate-with MODEL", "--policy", "--resume ", "--resume-from PATH", "--quiet"):
        assert option in section, option
    assert "Serve MODEL (a preset or HF directory)" in section and "--help" not in section
    assert text.index("Commands:") < text.index("Main form options")


def test_profile_writes_and_reuses_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    first = CliRunner().invoke(main, ["profile", "--model", "tiny", "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert json.loads(out.read_text())["samples"]
    out.write_text("{ not json")
    again = CliRunner().invoke(main, ["profile", "--model", "tiny", "--out", str(out), "--ladder-step", "8"])
    assert again.exit_code == 0, again.output
    assert json.loads(out.read_text())["samples"]  # the corrupt file was rebuilt, not used
    odd = CliRunner().invoke(main, ["profile", "--model", "tiny", "--out", str(out), "--ladder-step", "12"])
    assert odd.exit_code == 2 and "--ladder-step" in odd.output and "Traceback" not in odd.output
    (tmp_path / "afile").write_text("")
    blocked = CliRunner().invoke(
        main, ["profile", "--model", "tiny", "--out", str(tmp_path / "afile" / "p.json")]
    )
    assert blocked.exit_code == 1 and "afile is a file, not a folder" in blocked.output
    assert "profiled" not in blocked.output  # refused before any step was timed


def test_serve_trace_needs_exactly_one_load(tmp_path):
    result = CliRunner().invoke(main, ["serve-trace", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "exactly one of --trace and --rate" in result.output


@pytest.mark.parametrize(
    ("error", "code", "shown"),
    [
        (
            RecipeError("r.yaml", "train.lr", "a number > 0", "0"),
            2,
            "r.yaml: train.lr: expected a number > 0",
        ),
        (ModelError("m/config.json: hidden_size: expected an integer"), 2, "m/config.json: hidden_size"),
        (DataError("d.jsonl:3: invalid JSON"), 2, "d.jsonl:3: invalid JSON"),
        (AdapterError("a/adapter_config.json: no 'r'"), 2, "a/adapter_config.json: no 'r'"),
        (CheckpointError("c/trainer_state.pt: cannot be read"), 2, "c/trainer_state.pt: cannot be read"),
        (TraceError("t.jsonl:2: not UTF-8 text"), 2, "t.jsonl:2: not UTF-8 text"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "x.bin"), 2, "file not found: x.bin"),
        (TrainingDiverged(4, "loss", float("nan"), None), 1, "training diverged at step 4: the loss is nan"),
        (RequestRefused("request 0 refused: too long", Sequence(0, [1], None, 0.0)), 1, "request 0 refused"),
        (EngineError("engine: requests are queued but none can be scheduled"), 1, "none can be scheduled"),
        (ProfileError("the re-profile was made for another GPU", "stale"), 1, "re-profile"),
        (OSError(errno.ENOSPC, "No space left on device", "run/adapter"), 1, "run/adapter: No space left"),
        (
            NotADirectoryError(errno.ENOTDIR, "Not a directory", "f/run"),
            1,
            "f/run: Not a directory (ENOTDIR)",
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_each_error_class_exits_with_its_code_and_one_line(monkeypatch, error, code, shown):
    # 2: the command line, the recipe or an input file is wrong; 1: the run failed while working.
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("harli_train.config.load_recipe", fail)
    result = CliRunner().invoke(main, [str(ROOT / "recipes" / "quickstart.yaml")])
    assert result.exit_code == code, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and shown in lines[0], lines


def test_a_command_line_mistake_is_a_usage_error():
    result = CliRunner().invoke(main, ["generate"])  # --prompt is required
    assert result.exit_code == 2 and "--prompt" in result.output


def test_generate_with_a_prompt_past_the_context_exits_1_with_one_line():
    # tiny's context is 2048 tokens; its byte-level tokenizer adds a BOS to the prompt's bytes.
    for prompt, max_tokens, total in (("x" * 3000, 8, 3009), ("y" * 2040, 16, 2057)):
        result = CliRunner().invoke(
            main, ["generate", "--prompt", prompt, "--max-tokens", str(max_tokens), "--device", "cpu"]
        )
        assert result.exit_code == 1, result.output[-300:]
        lines = [line for line in result.output.splitlines() if not line.startswith("harli-train: ")]  # logs
        assert len(lines) == 1 and "Traceback" not in result.output, lines
        prompt_tokens = len(prompt) + 1
        assert f"its prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {total}" in lines[0]
        assert "exceeds the model's context of 2048 tokens" in lines[0]
