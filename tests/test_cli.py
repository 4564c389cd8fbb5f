"""The command line's verbs: help and version, profile, serve-trace."""

import json

from click.testing import CliRunner

from harli_train import __version__
from harli_train.cli import main


def test_help_lists_every_verb_and_version():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for verb in ("train", "generate", "serve-trace", "profile"):
        assert verb in result.output
    assert "RECIPE.yaml" in result.output
    assert __version__ in CliRunner().invoke(main, ["--version"]).output
    train_help = CliRunner().invoke(main, ["train", "--help"]).output
    for option in ("--colocate-with", "--policy", "--resume", "--resume-from", "--quiet"):
        assert option in train_help


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


def test_serve_trace_needs_exactly_one_load(tmp_path):
    result = CliRunner().invoke(main, ["serve-trace", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "exactly one of --trace and --rate" in result.output
