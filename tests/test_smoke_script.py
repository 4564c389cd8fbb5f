"""bench/smoke_gpu.sh covers every command the README shows (it runs them on the GPU machine)."""

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> set[str]:
    """Each `harli-train ...` command in the README's shell blocks (synopses with [options] left out)."""
    text = (ROOT / "README.md").read_text()
    commands = set()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                part = re.sub(r"\s+#.*$", "", part).strip()
                if part.startswith("harli-train") and "[" not in part:
                    commands.add(" ".join(shlex.split(part)))
    return commands


def smoke_forms() -> set[str]:
    text = (ROOT / "bench" / "smoke_gpu.sh").read_text()
    lines = re.findall(r"^\s*readme_form .*$", text, flags=re.M)
    return {" ".join(shlex.split(shlex.split(line.strip())[1])) for line in lines}


def test_smoke_script_runs_every_readme_command():
    readme, smoke = readme_commands(), {c for f in smoke_forms() for c in f.split(" ; ")}
    readme = {c for cmd in readme for c in cmd.split(" ; ")}
    assert len(readme) >= 8, readme
    assert readme <= smoke, f"README commands bench/smoke_gpu.sh does not run: {sorted(readme - smoke)}"


def test_smoke_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "smoke_gpu.sh")], check=True)


def test_the_smoke_logs_a_hash_of_the_code_that_ran(tmp_path):
    """The smoke's first line names the tree by its files (bench/tree_hash.sh), the same in a copy of the
    checkout without git, and different once one code file changes."""
    import shutil

    def tree_hash(root: Path) -> str:
        out = subprocess.run(["bash", str(root / "bench" / "tree_hash.sh")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    skip = shutil.ignore_patterns("__pycache__", "results", "profiles", "*.so")
    for part in ("harli_train", "allocator", "bench", "tests"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=skip)
    here = tree_hash(ROOT)
    assert len(here) == 12 and tree_hash(tmp_path) == here
    with open(tmp_path / "harli_train" / "__init__.py", "a") as f:
        f.write("\n")
    assert tree_hash(tmp_path) != here
    assert "tree_hash.sh" in (ROOT / "bench" / "smoke_gpu.sh").read_text()


def test_a_smoke_step_is_skipped_past_the_budget_and_cut_where_it_ends(tmp_path):
    """bench/smoke_run.sh's ``run``: a step within the budget that ends in time passes; one still running
    when the budget ends is cut there (FAIL, saying so) instead of running on to its own limit; one that
    would start past the budget is a SKIP; both count as not passed."""
    script = f"""
set -u
log={tmp_path}/log; scratch={tmp_path}; part=all; results=(); failed=0
start_all=$(date +%s); budget_s=2
source {ROOT}/bench/smoke_run.sh
run quick 30 "true" -- true
run slow 30 "true" -- sleep 20
run late 30 "true" -- true
printf '%s\\n' "${{results[@]}}"; echo "failed $failed"; echo "took $(($(date +%s) - start_all))"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if not line.startswith("===")]  # the notes
    assert lines[0].startswith("PASS quick")
    assert lines[1].startswith("FAIL slow") and "cut at the 2s budget" in lines[1]
    assert lines[2].startswith("SKIP late") and "past the 2s budget" in lines[2]
    assert lines[3] == "failed 2" and int(lines[4].split()[1]) < 10
