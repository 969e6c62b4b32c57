#!/usr/bin/env bash
# Config parsing of every tiny and full-size model (tests/models/tiny_hybrids) and
# Gemma 4's per-layer shapes and engine boot path (config, hash, model class on the
# meta device, multimodal processor), under the transformers releases the wheel allows besides
# the test env's own (5.14.1): 5.17.0 (the GPU image's) and 5.23.0 (the newest the
# wheel's METADATA admits, requirements/wheel-requires.txt). Each release is a small
# overlay (transformers + tokenizers, --no-deps) put ahead of the test env on
# PYTHONPATH; everything else is the test env's. About 1 minute per release on 2 cores.
#   usage: bash scripts/test-transformers.sh [VERSION...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDKV_VENV:-.venv}
py="$VENV/bin/python"
export HF_HUB_OFFLINE=1
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(5.17.0 5.23.0)
tests=(tests/models/tiny_hybrids/test_tiny_configs.py)
for t in tests/transformers_utils/test_per_layer_config.py \
  tests/model_executor/models/test_gemma4_engine_boot.py; do
  [ -f "$t" ] && tests+=("$t")
done
rc=0
for v in "${versions[@]}"; do
  overlay=".hybridkv/transformers/$v"
  if [ ! -f "$overlay/.done" ]; then
    rm -rf "$overlay"
    "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$overlay" \
      "transformers==$v" "tokenizers>=0.23.1,<0.24" 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    touch "$overlay/.done"
  fi
  printf '\n== transformers %s\n' "$v"
  PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
    'import transformers; assert transformers.__version__ == "'"$v"'", transformers.__file__'
  PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -p no:cacheprovider \
    "${tests[@]}" || rc=1
done
exit "$rc"
