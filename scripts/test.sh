#!/usr/bin/env bash
# hybridkv's tests, from a fresh CPU-only machine: runs scripts/setup.sh (the main job),
# then lint, our tests and vLLM 0.20.2's own tests for the code the series touches
# (against the installed wheel) and, beside them, our Triton kernel tests under the CPU
# interpreter, each patch's tests at its place in the series and a fresh install's
# resolve. GPU tests (-m gpu) are skipped here; they run on the GPU host through
# scripts/gpu-suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDKV_VENV:-.venv}
# Every step reports its processor time: on CI's two cores the script's length is
# bound by their sum, not by the longest step. A step in line is timed in a subshell
# of its own: timed in this shell it would also count a step beside that ended
# meanwhile. prefix-test's pytest runs are forks of its fork server, which it does
# not wait for: their sum is on its last line.
TIMEFORMAT='(cpu: %U s user, %S s system; %R s wall)'
time bash scripts/setup.sh
export HF_HUB_OFFLINE=1
py="$(cd "$VENV" && pwd)/bin/python"  # absolute: the upstream tests run from another folder
# The side steps' logs and the resolve's pytest folder, gone when the script ends.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The kernel tests run under the interpreter twice, at their patch's place and
# against the wheel; a launch one run made with the same code and bytes is read
# back by the other (hybridkv/testing/interpreter_memo.py).
export HYBRIDKV_INTERPRET_MEMO="$scratch/interpret-memo"

# Steps that share nothing with the ones in line but read-only files run beside them:
# CI has two cores, every step is one process, and the resolve mostly waits on PyPI. In
# line, they put this script past its 15 minutes on a 2-core box; the transformers step
# beside them too did not make it shorter there (942 s against 761-880 s).
# `beside NAME CMD...` starts one; `report NAME TITLE LINES` waits for it and prints its
# last LINES lines (0: all), or all of it and stops the script if it failed.
# The steps beside run at a lower priority: the steps in line take the CPU they need
# and the ones beside take the rest (at equal priority the line's pytest step took
# 703 s, niced 332-392 s, and the script 923 s against 862 s).
declare -A step_pid step_log
beside() {
  local name=$1
  shift
  step_log[$name]=$(mktemp -p "$scratch")
  # Its log ends with when it ended, in seconds since this script started.
  {
    local rc=0
    time nice -n 10 "$@" || rc=$?
    printf '(ended at %d s)\n' "$SECONDS"
    exit "$rc"
  } >"${step_log[$name]}" 2>&1 &
  step_pid[$name]=$!
}
report() {
  printf '\n== %s (ran beside the steps above; waited for at %d s)\n' "$2" "$SECONDS"
  if ! wait "${step_pid[$1]}"; then
    cat "${step_log[$1]}"
    exit 1
  fi
  if [ "$3" -eq 0 ]; then cat "${step_log[$1]}"; else tail -n "$(($3 + 1))" "${step_log[$1]}"; fi
}

# The fresh-install resolve (pip --dry-run against PyPI) waits on the network.
beside resolve "$py" -m pytest -q -p no:cacheprovider --basetemp="$scratch/resolve" \
  tests/hybridkv/test_wheel_requires.py -k test_fresh_install_resolves_a_set_that_runs_gemma4
# Each patch at its place: link farms of the pristine wheel, PYTHONPATH-only; the last
# patch's place is the wheel tested below. Two at a time: once the steps in line end,
# this one ran alone on one core for 4 of the script's 13 minutes.
# The steps beside the ones in line take one thread each: with torch's default of one per
# core, four processes ran eight on two cores.
beside prefix env OMP_NUM_THREADS=1 "$VENV/bin/hybridkv" prefix-test --skip-full --jobs 2
# Its own process: the interpreter must be chosen before Triton and vLLM load.
# The read-back benchmark's file runs here too: two of its tests drive the
# kernels (triton_interpret), which the line's run above skips.
beside kernels env HYBRIDKV_TRITON_INTERPRET=1 OMP_NUM_THREADS=1 "$py" -m pytest tests/kernels \
  tests/benchmarks/test_turboquant_readback_benchmark.py -q -p no:cacheprovider

printf '\n== lint: ruff %s with vLLM 0.20.2'"'"'s config (overlay, tests, the lines hooks add) (at %d s)\n' 0.14.0 "$SECONDS"
(time "$VENV/bin/hybridkv" lint)

printf '\n== hybridkv tests (tests/) (at %d s)\n' "$SECONDS"
(time HYBRIDKV_SKIP_RESOLVE=1 "$py" -m pytest tests -q -p no:cacheprovider "$@")

printf '\n== model configs under transformers 5.17.0 and 5.23.0 (scripts/test-transformers.sh) (at %d s)\n' "$SECONDS"
(time HYBRIDKV_VENV="$VENV" bash scripts/test-transformers.sh)

printf '\n== vLLM 0.20.2 tests for the code the series touches (from the sdist) (at %d s)\n' "$SECONDS"
cd "$("$py" -c 'from hybridkv.base import upstream_tests_dir; print(upstream_tests_dir())')"
mapfile -t upstream < <(grep -v "^#" "$OLDPWD/tests/upstream_tests.txt" | grep .)
(time "$py" -m pytest -q -p no:cacheprovider -p hybridkv.testing.pytest_plugin \
  --deselect-file="$OLDPWD/tests/upstream_deselect.txt" \
  --model-redirect-dir="$OLDPWD/tests/upstream_models" "${upstream[@]}")
mapfile -t interpret < <(grep -v "^#" "$OLDPWD/tests/upstream_tests_interpret.txt" | grep .)
(time HYBRIDKV_TRITON_INTERPRET=1 "$py" -m pytest -q -p no:cacheprovider \
  -p hybridkv.testing.pytest_plugin --model-redirect-dir="$OLDPWD/tests/upstream_models" "${interpret[@]}")

report kernels "Triton kernels under the CPU interpreter (tests/kernels, the read-back benchmark's)" 2
report prefix "each patch at its place: patches 1..N on pristine vLLM, patch N's tests" 0
report resolve "fresh pip install of the wheel resolves a set that runs Gemma 4 (PyPI)" 3
