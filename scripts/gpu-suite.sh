#!/usr/bin/env bash
# On the GPU host: run the GPU tests (-m gpu) against a vLLM runtime and write a log.
#   usage: bash scripts/gpu-suite.sh [RUNTIME_PREFIX] [pytest args or test paths; default: tests]
# RUNTIME_PREFIX is where ../shared/gpu-runtime/unpack.sh put the (patched) vLLM
# runtime (default /opt/hkv); the log goes to $OUT/gpu-suite.log, else ./gpu-suite.log.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-runtime-env.sh "${1:-}"
shift || true
log=${OUT:-.}/gpu-suite.log
{
  echo "== $(date -u +%FT%TZ) gpu-suite on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, importlib.metadata as m; print("torch", torch.__version__, "triton", triton.__version__, "vllm", m.version("vllm"))'
  python3 -m hybridkv report
  python3 -m pytest -m gpu -v -s -p no:cacheprovider "${@:-tests}"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
