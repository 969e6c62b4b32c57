#!/usr/bin/env bash
# The build half of scripts/setup.sh, on its own so that the Docker image's build stage
# (docker/Dockerfile) runs the very steps CI runs: pristine vLLM 0.20.2 fetched from PyPI
# and checked against requirements/vllm-base.txt, the series checked against it, the
# patched wheel written to dist/. It needs nothing but Python >= 3.11 (the series tool
# uses the standard library only).
#   usage: bash scripts/build-wheel.sh [SERIES_TOOL_COMMAND...]   (default: python3 -m hybridkv)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then set -- "${PYTHON:-python3}" -m hybridkv; fi

step() { printf '\n== %s\n' "$*"; }

step "pristine vLLM (PyPI, sha256 from requirements/vllm-base.txt)"
"$@" fetch

step "series against pristine vLLM"
"$@" check

step "patched wheel"
"$@" wheel
