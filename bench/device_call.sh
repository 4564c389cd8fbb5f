#!/usr/bin/env bash
# One call of the `device` tool: install once, then run STEPs in turn within the call's time, and pack what
# they wrote into one archive ($OUT/$TAG.tar.gz; a call returns at most 8 files).
#
#   bash bench/device_call.sh colocate "--trace steady --loads light --policies harli --repeats 3" smoke
#   TAG=call2 CALL_S=570 bash bench/device_call.sh pool "--window-s 15 --windows 3"
#
# STEPs:
#   colocate "ARGS"  python bench/bench_colocate.py --objectives auto:1.5 --profile P --standalone S
#                    --keep-steps 3000 --time-budget-s <what is left> ARGS (ARGS may override any of them)
#   pool "ARGS"      python bench/bench_pool.py --profile P ARGS (under `timeout` for what is left)
#   profile "ARGS"   make P again: bench_colocate.py's set-up and profile alone (--policies none), ~3 min on
#                    the H200; the later steps of the call use it and it comes back in the archive
#   smoke            bash bench/smoke_gpu.sh, SMOKE_BUDGET_S set to what is left
#   cmd "COMMAND"    bash -c COMMAND (e.g. a co-located main job), with OUT set to the step's folder
# P is the stored profile of this GPU (bench/profiles/, unpacked; a run that adds to it, such as the adapter
# steps of a --live-fraction cell, rewrites it, and it comes back in the archive); S is the standalone rates
# file of the matrix (STANDALONE; default: the newest bench/results/*-bench_colocate-standalone*.json measured
# on this GPU with the trainer as the step's ARGS run it, graphed or eager: `standalone_for`).
# CALL_S is the call's own limit (default 570 s, under the tool's 600); a step starts only with 60 s left.
# Each step writes under $OUT/$TAG/<n>-<step>/; the tables each prints last are echoed at the end.
set -u
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 1
OUT="${OUT:-$repo/bench_out}"
TAG="${TAG:-call}"
CALL_S="${CALL_S:-570}"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
# standalone_for GRAPHS: STANDALONE, else the newest stored standalone rates of this GPU with the trainer's
# steps graphed (GRAPHS 1) or eager (0; a file without `cuda_graphs` was eager), else the H200's of 2026-12-04
# (bench_colocate measures rates again when the file's GPU or trainer is not the run's).
standalone_for() {
  if [ -n "${STANDALONE:-}" ]; then
    echo "$STANDALONE"
    return
  fi
  found=$(python - "$gpu_name" "$1" "$repo"/bench/results/*-bench_colocate-standalone*.json <<'PY'
import json, sys
name, graphs, files = sys.argv[1], sys.argv[2] == "1", sorted(sys.argv[3:], reverse=True)
rates = {f: json.load(open(f)) for f in files}
print(next((f for f, r in rates.items() if (r.get("gpu_name"), bool(r.get("cuda_graphs"))) == (name, graphs)), ""))
PY
  )
  echo "${found:-$repo/bench/results/2026-12-04-bench_colocate-standalone.json}"
}
# 1 when a step's ARGS run the trainer's steps as CUDA graphs
graphed() { case " $1 " in *train.cuda_graphs=true*) echo 1 ;; *) echo 0 ;; esac; }
start=$(date +%s)
# The steps are checked before anything runs: a typo must not cost a device call's set-up.
rest=("$@")
i=0
while [ $i -lt ${#rest[@]} ]; do
  case ${rest[$i]} in
    colocate | pool | cmd | profile) i=$((i + 2)) ;;
    smoke) i=$((i + 1)) ;;
    *)
      echo "unknown step '${rest[$i]}' (colocate \"ARGS\", pool \"ARGS\", profile \"ARGS\", cmd \"COMMAND\", smoke)" >&2
      exit 2
      ;;
  esac
done
work="$OUT/$TAG"
# A machine may keep $OUT from an earlier call of this TAG: its step folders are not this call's.
rm -rf "$work"
mkdir -p "$work"
log="$work/call.log"
left() { echo $((CALL_S - ($(date +%s) - start))); }

# DEVICE_CALL_INSTALL=0: the project is installed already (the tests)
if [ "${DEVICE_CALL_INSTALL:-1}" != 0 ] && ! python -m pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1; then
  echo "install failed"
  tail -n 30 "$log"
  exit 1
fi
git rev-parse HEAD >>"$log" 2>&1
bash bench/tree_hash.sh >>"$log" 2>&1
profile="$work/profile.json"
# A profile an earlier call made on this (still warm) machine is kept in the ignored bench_out/, so that a
# GPU with no stored profile (an H100) profiles once per machine, not once per call (DEVICE_CALL_CACHE: where).
cached="${DEVICE_CALL_CACHE:-$repo/bench_out}/device-call-profile.json"
# The stored profile of this GPU (bench/profiles/<name, spaces as _>-*.json.gz), else the first stored one.
gpu=$(echo "$gpu_name" | tr ' ' '_')
stored=$(ls bench/profiles/"${gpu:-none}"-*.json.gz 2>/dev/null | head -n 1)
stored=${stored:-$(ls bench/profiles/*.json.gz 2>/dev/null | head -n 1)}
if [ -s "$cached" ]; then
  cp "$cached" "$profile"
  echo "profile: kept from an earlier call on this machine" >>"$log"
elif [ -n "$stored" ]; then
  gunzip -c "$stored" >"$profile"
  echo "profile: $stored" >>"$log"
fi
echo "gpu: ${gpu_name:-none}" >>"$log"
# A profile made beside the eagerly launched workload (no `meta.corun_workload` "graphed"), whose queue ran
# dry beside small decode shares (~1.35x low on 32 SMs on the H100), is made again by the first step that
# needs it (~4 min, inside that step): say so, so that a call makes it first (profile "").
if [ -s "$profile" ] && python - "$profile" <<'PY'; then
import json, sys
sys.exit(0 if json.load(open(sys.argv[1])).get("meta", {}).get("corun_workload") != "graphed" else 1)
PY
  echo "profile check: not made beside the graphed co-run workload; make it again first (profile \"\")" |
    tee -a "$log"
fi
echo "standalone: $(standalone_for 0)" >>"$log"
echo "standalone graphed: $(standalone_for 1)" >>"$log"

n=0
tables=()
while [ $# -gt 0 ]; do
  step=$1
  shift
  args=""
  if [ "$step" != smoke ]; then
    args=${1:-}
    shift || true
  fi
  n=$((n + 1))
  dir="$work/$n-$step"
  mkdir -p "$dir"
  budget=$(($(left) - 30))
  if [ "$budget" -lt 60 ]; then
    echo "=== $n $step: skipped, ${budget}s left ===" | tee -a "$log"
    continue
  fi
  echo "=== $n $step $args (${budget}s left) ===" | tee -a "$log"
  t0=$(date +%s)
  case $step in
    colocate)
      # shellcheck disable=SC2086  # ARGS are words
      OUT="$dir" timeout -s INT -k 20 "$((budget + 20))s" python bench/bench_colocate.py \
        --objectives auto:1.5 --profile "$profile" --standalone "$(standalone_for "$(graphed "$args")")" \
        --keep-steps 3000 \
        --time-budget-s "$budget" $args >"$dir/log" 2>&1
      ;;
    pool)
      # shellcheck disable=SC2086
      OUT="$dir" timeout -s INT -k 20 "${budget}s" python bench/bench_pool.py --profile "$profile" \
        --out "$dir/bench_pool.json" $args >"$dir/log" 2>&1
      ;;
    profile)
      # shellcheck disable=SC2086
      OUT="$dir" timeout -s INT -k 20 "${budget}s" python bench/bench_colocate.py --objectives auto:1.5 \
        --policies none --trace steady --loads light --profile "$dir/profile.json" \
        --standalone "$(standalone_for "$(graphed "$args")")" $args >"$dir/log" 2>&1 &&
        mv "$dir/profile.json" "$profile"
      ;;
    smoke)
      # the smoke cuts its own steps at its budget; the timeout is a backstop that keeps the call's archive
      OUT="$dir" SMOKE_BUDGET_S="$budget" SMOKE_PROFILE="$profile" timeout -s INT -k 20 "$((budget + 30))s" \
        bash bench/smoke_gpu.sh >"$dir/log" 2>&1
      ;;
    cmd)
      OUT="$dir" timeout -s INT -k 20 "${budget}s" bash -c "$args" >"$dir/log" 2>&1
      ;;
  esac
  rc=$?
  echo "=== $n $step: exit $rc after $(($(date +%s) - t0))s ===" | tee -a "$log"
  tables+=("$dir/log")
  if [ -s "$profile" ]; then  # after every step: a call cut short by the tool's limit keeps it too
    mkdir -p "$(dirname "$cached")" && cp "$profile" "$cached"
  fi
done

find "$work" -name '*-timelines.tar.gz' -delete
# Weights a main job writes (the adapter, checkpoints) would outgrow what a call brings back: files over
# 4 MiB stay behind, named in the call's log.
find "$work" -type f -size +4M -print -delete | sed 's/^/left behind (over 4 MiB): /' | tee -a "$log"
tar czf "$OUT/$TAG.tar.gz" -C "$OUT" "$TAG"
for t in "${tables[@]}"; do
  echo "--- ${t#"$OUT"/}"
  tail -n 12 "$t"
done
rm -rf "$work"  # what comes back is the archive
echo "packed $OUT/$TAG.tar.gz ($(du -h "$OUT/$TAG.tar.gz" | cut -f1)) in $(($(date +%s) - start))s"
