# The smoke's step runner, sourced by bench/smoke_gpu.sh (and tests/test_smoke_script.py). It reads the
# caller's variables: log (the log file), scratch (the folder commands run in), part (SMOKE_PART), start_all
# and budget_s (the smoke's start, in epoch seconds, and its budget in seconds); it appends one verdict line
# a run to the array results and counts the runs not passed in failed.
# shellcheck shell=bash

note() { echo "$*" | tee -a "$log"; }

# run NAME LIMIT_S CHECK -- COMMAND...: COMMAND in the scratch folder (stdout in $scratch/NAME.out, stderr in
# $scratch/NAME.err, both appended to the log); CHECK is a bash expression evaluated there afterwards.
# The GPU tests' runs are named gpu-tests-*; SMOKE_PART leaves out the other part's runs. A run starts only
# within the budget (else SKIP) and is cut where the budget ends (FAIL, "cut at the budget"), so that a
# smoke given what is left of a device call ends inside it.
run() {
  local name=$1 limit=$2 check=$3
  shift 4
  local t0 rc verdict why=""
  case "$part/$name" in tests/install | tests/gpu-tests-* | commands/install) ;;
    tests/* | commands/gpu-tests-*) return ;; esac
  t0=$(date +%s)
  local left=$((budget_s - (t0 - start_all))) cut=0
  if [ "$left" -le 0 ]; then
    results+=("$(printf '%-4s %-28s %4ss  %s' SKIP "$name" 0 "past the ${budget_s}s budget")")
    failed=$((failed + 1))
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left cut=1
  note "=== $name ($(date -u +%T)): $*"
  (cd "$scratch" && timeout -s INT -k 15 "$limit" "$@" >"$scratch/$name.out" 2>"$scratch/$name.err")
  rc=$?
  cat "$scratch/$name.out" "$scratch/$name.err" >>"$log"
  if [ "$rc" -eq 124 ] && [ "$cut" = 1 ]; then
    verdict=FAIL why="cut at the ${budget_s}s budget (${limit}s were left of it)"
  elif [ "$rc" -ne 0 ]; then
    verdict=FAIL why="exit $rc"
    [ "${name#gpu-tests}" != "$name" ] && why="exit $rc: $(tail -n 1 "$scratch/$name.out")"
  elif grep -q -E "terminate called|Traceback|CUDA error" "$scratch/$name.err"; then
    verdict=FAIL why="abort or traceback on stderr"
  elif ! (cd "$scratch" && eval "$check") >>"$log" 2>&1; then
    verdict=FAIL why="check failed: $check"
  else
    verdict=PASS
  fi
  [ "$verdict" = PASS ] || failed=$((failed + 1))
  results+=("$(printf '%-4s %-28s %4ss  %s' "$verdict" "$name" "$(($(date +%s) - t0))" "$why")")
  note "=== $name: $verdict ($rc) $why"
}

# chain GROUP FUNCTION: FUNCTION's `run` lines one after another in the background, beside the other
# chains; their log and verdicts are kept apart until `collect_chains` adds them, in the chains' order.
chains=()
chain() {
  local group=$1
  chains+=("$group")
  (log="$scratch/chain-$group.log"; : >"$log"; results=(); failed=0; "$2"
   printf '%s\n' "${results[@]}" >"$scratch/chain-$group.part"
   mv "$scratch/chain-$group.part" "$scratch/chain-$group.result") &
}
collect_chains() {
  local group line
  wait
  for group in "${chains[@]}"; do
    cat "$scratch/chain-$group.log" >>"$log" 2>/dev/null
    if [ ! -f "$scratch/chain-$group.result" ]; then
      results+=("$(printf '%-4s %-28s %4ss  %s' FAIL "$group" 0 "no verdict")"); failed=$((failed + 1)); continue
    fi
    while IFS= read -r line; do
      [ -n "$line" ] || continue
      results+=("$line")
      case "$line" in PASS*) ;; *) failed=$((failed + 1)) ;; esac
    done <"$scratch/chain-$group.result"
  done
}

