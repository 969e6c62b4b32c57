#!/usr/bin/env bash
# hybridkv's tests, from a fresh CPU-only machine: runs scripts/setup.sh (the main job),
# then lint, our tests, vLLM 0.20.2's own tests for the code the series touches (against
# the installed wheel) and, beside them, our Triton kernel tests under the CPU interpreter
# and each patch's tests at its place in the series. GPU tests (-m gpu) are skipped here;
# they run on the GPU host through scripts/gpu-suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDKV_VENV:-.venv}
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
py="$(cd "$VENV" && pwd)/bin/python"  # absolute: the upstream tests run from another folder

# The fresh-install resolve (pip --dry-run against PyPI) waits on the network, not the
# CPU: it runs beside the steps below and is reported at the end.
resolve_log=$(mktemp)
"$py" -m pytest -q -p no:cacheprovider --basetemp="$(mktemp -d)" tests/hybridkv/test_wheel_requires.py \
  -k test_fresh_install_resolves_a_set_that_runs_gemma4 >"$resolve_log" 2>&1 &
resolve_pid=$!

# Each patch at its place runs beside the steps below: CI has two cores and every step is
# one pytest process, and the prefix trees share nothing with them but read-only files
# (link farms of the pristine wheel, PYTHONPATH-only). Reported after them.
prefix_log=$(mktemp)
"$VENV/bin/hybridkv" prefix-test --skip-full >"$prefix_log" 2>&1 &  # the last patch's place is the wheel tested below
prefix_pid=$!

# The Triton kernels under the CPU interpreter share nothing with the steps below either
# (their own process: the interpreter must be chosen before Triton and vLLM load), so
# they run beside them too. In line, they put this script at 15.3 minutes on a 2-core
# box where its CI limit is 15. Reported after them.
kernels_log=$(mktemp)
HYBRIDKV_TRITON_INTERPRET=1 "$py" -m pytest tests/kernels -q -p no:cacheprovider >"$kernels_log" 2>&1 &
kernels_pid=$!

printf '\n== lint: ruff %s with vLLM 0.20.2'"'"'s config (overlay, tests, the lines hooks add)\n' 0.14.0
"$VENV/bin/hybridkv" lint

printf '\n== hybridkv tests (tests/)\n'
HYBRIDKV_SKIP_RESOLVE=1 "$py" -m pytest tests -q -p no:cacheprovider "$@"

printf '\n== model configs under transformers 5.17.0 and 5.23.0 (scripts/test-transformers.sh)\n'
HYBRIDKV_VENV="$VENV" bash scripts/test-transformers.sh

printf '\n== vLLM 0.20.2 tests for the code the series touches (from the sdist)\n'
cd "$("$py" -c 'from hybridkv.base import upstream_tests_dir; print(upstream_tests_dir())')"
mapfile -t upstream < <(grep -v "^#" "$OLDPWD/tests/upstream_tests.txt" | grep .)
"$py" -m pytest -q -p no:cacheprovider -p hybridkv.testing.pytest_plugin \
  --deselect-file="$OLDPWD/tests/upstream_deselect.txt" \
  --model-redirect-dir="$OLDPWD/tests/upstream_models" "${upstream[@]}"
mapfile -t interpret < <(grep -v "^#" "$OLDPWD/tests/upstream_tests_interpret.txt" | grep .)
HYBRIDKV_TRITON_INTERPRET=1 "$py" -m pytest -q -p no:cacheprovider -p hybridkv.testing.pytest_plugin \
  --model-redirect-dir="$OLDPWD/tests/upstream_models" "${interpret[@]}"

printf '\n== Triton kernels under the CPU interpreter (tests/kernels, ran beside the steps above)\n'
if ! wait "$kernels_pid"; then
  cat "$kernels_log"
  exit 1
fi
tail -n 1 "$kernels_log"

printf '\n== each patch at its place: patches 1..N on pristine vLLM, patch N'"'"'s tests (ran beside the steps above)\n'
if ! wait "$prefix_pid"; then
  cat "$prefix_log"
  exit 1
fi
cat "$prefix_log"

printf '\n== fresh pip install of the wheel resolves a set that runs Gemma 4 (PyPI, ran beside the steps above)\n'
if ! wait "$resolve_pid"; then
  cat "$resolve_log"
  exit 1
fi
tail -n 3 "$resolve_log"
