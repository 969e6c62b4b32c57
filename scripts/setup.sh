#!/usr/bin/env bash
# hybridkv's main job, from a fresh CPU-only machine: a test venv, pristine vLLM 0.20.2
# fetched and verified, the series checked against it, the patched wheel built and
# installed, and a report of what that install carries. Safe to run again: each step
# is skipped or redone quickly when its inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${HYBRIDKV_VENV:-.venv}

step() { printf '\n== %s\n' "$*"; }

# pip install into the venv, without the index's noise; an out-of-disk failure names
# no size, so on failure say what was free.
pip_install() {
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } \
    || { df -h "$VENV" "${TMPDIR:-/tmp}" >&2; return 1; }
}

step "test environment ($VENV): requirements/cpu-test.txt"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.hybridkv-requirements"
want=$(cat requirements/cpu-test.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # No pip cache: a fresh machine never reads it back. And the CUDA build of torch and
  # its nvidia-* libraries (~3 GB of wheels, ~5 GB installed) go in one call each: pip
  # keeps every downloaded wheel of a call until the call ends, so one call for the
  # whole file held the downloads beside the ~7 GB install. CI ran out of disk there twice.
  for req in $(grep -E '^(torch|triton|nvidia-[a-z0-9-]+)==' requirements/cpu-test.txt); do
    pip_install --no-deps "$req"
  done
  pip_install -r requirements/cpu-test.txt
  # Editable: the tooling finds patches/ and the overlay through its own path.
  pip_install --no-deps -e .
  echo "$want" > "$stamp"
fi
hk="$VENV/bin/hybridkv"

bash scripts/build-wheel.sh "$hk"  # fetch + verify, check, wheel (docker/Dockerfile runs it too)
wheel=$(ls -t dist/vllm-*+hybridkv.*.whl | head -n 1)

step "install $wheel (no deps: the CPU test env supplies them)"
pip_install --no-deps --force-reinstall "$wheel"
"$hk" check --installed

step "report"
"$hk" report
