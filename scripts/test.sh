#!/usr/bin/env bash
# hybridkv's tests, from a fresh CPU-only machine: runs scripts/setup.sh (the main job),
# then our tests and vLLM 0.20.2's own tests for the code the series touches, both
# against the installed patched wheel. GPU tests (-m gpu) are skipped here; they run
# on the GPU host through scripts/gpu-suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDKV_VENV:-.venv}
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
py="$(cd "$VENV" && pwd)/bin/python"  # absolute: the upstream tests run from another folder

printf '\n== hybridkv tests (tests/)\n'
"$py" -m pytest tests -q -p no:cacheprovider "$@"

printf '\n== model configs under transformers 5.17.0 and 5.23.0 (scripts/test-transformers.sh)\n'
HYBRIDKV_VENV="$VENV" bash scripts/test-transformers.sh

printf '\n== Triton kernels under the CPU interpreter (tests/kernels)\n'
# Its own process: the interpreter must be chosen before Triton and vLLM load.
HYBRIDKV_TRITON_INTERPRET=1 "$py" -m pytest tests/kernels -q -p no:cacheprovider

printf '\n== vLLM 0.20.2 tests for the code the series touches (from the sdist)\n'
cd "$("$py" -c 'from hybridkv.base import upstream_tests_dir; print(upstream_tests_dir())')"
mapfile -t upstream < <(grep -v "^#" "$OLDPWD/tests/upstream_tests.txt" | grep .)
"$py" -m pytest -q -p no:cacheprovider -p hybridkv.testing.pytest_plugin \
  --deselect-file="$OLDPWD/tests/upstream_deselect.txt" "${upstream[@]}"
