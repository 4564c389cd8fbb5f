#!/usr/bin/env bash
# On the GPU machine: install, then run benchmarks one after another, each under its own time limit.
#   bash bench/run_gpu.sh train:420 kernels:240        # bench/bench_<name>.py, limit in seconds
#   bash bench/run_gpu.sh colocate:420:--tpot-ms=auto,--window-s=5   # extra arguments, comma-separated
# Every benchmark writes its JSON under $OUT; all output also goes to $OUT/gpu.log.
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
log="$OUT/gpu.log"
if ! python -m pip install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1; then
  echo "install failed"; tail -n 30 "$log"; exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
for spec in "$@"; do
  IFS=: read -r name limit extra <<<"$spec"
  IFS=, read -r -a shift_args <<<"${extra:-}"
  echo "=== bench_$name (limit ${limit}s) ===" | tee -a "$log"
  start=$(date +%s)
  timeout -s INT -k 20 "${limit}s" python "bench/bench_$name.py" "${shift_args[@]}" >>"$log" 2>&1
  rc=$?
  echo "=== bench_$name: exit $rc after $(( $(date +%s) - start ))s ===" | tee -a "$log"
  # The table each benchmark prints last.
  awk "/=== bench_$name \(/{f=1} f" "$log" | tail -n 25
done
