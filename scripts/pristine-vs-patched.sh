#!/usr/bin/env bash
# Each patch's tests (its Tests: field) against pristine vLLM 0.20.2, then against the
# patched wheel: a reproduction test must fail on the first and pass on the second.
# Needs scripts/setup.sh to have run; leaves the patched wheel installed.
#   usage: bash scripts/pristine-vs-patched.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDKV_VENV:-.venv}
py="$VENV/bin/python"
export HF_HUB_OFFLINE=1
mapfile -t tests < <("$py" -c '
from hybridkv.series import load_series
for p in load_series().patches:
    print(*p.listed("Tests"), sep="\n")')
pristine=$(ls .hybridkv/downloads/vllm-*.whl)
patched=$(ls -t dist/vllm-*+hybridkv.*.whl | head -n 1)
install() { "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$1" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
rc=0
for which in pristine patched; do
  wheel=$pristine; [ "$which" = patched ] && wheel=$patched
  install "$wheel"
  printf '\n== %s: %s\n' "$which" "$("$py" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))')"
  "$py" -m pytest -q -p no:cacheprovider -rA --tb=line --continue-on-collection-errors "${tests[@]}" "$@" 2>&1 \
    | grep -E "^(PASSED|FAILED|ERROR)|^/.*Error|^E |passed|failed"
  [ "$which" = patched ] && rc=${PIPESTATUS[0]}
done
exit "$rc"
