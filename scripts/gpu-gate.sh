#!/usr/bin/env bash
# The GPU release gate, in one device call: the speculative-decoding matrix's gate
# cells, the kernels against float64, the TurboQuant x hybrid matrix, the other GPU
# tests and the bad-token-id server check, on the GPUs there are.
#   usage: bash scripts/gpu-gate.sh [RUNTIME_PREFIX] [tests.gpu_gate options]
# RUNTIME_PREFIX is where ../shared/gpu-runtime/unpack.sh put the patched vLLM runtime
# (default /opt/hkv). Results go to $OUT/gate (else ./gate-out/gate): gate.md (the
# summary to keep as gates/<version>.md), gate.json and logs.tar.gz (each lane's logs
# and results), and nothing else (--keep-work keeps the checkpoints). Exit 0 only when
# every cell passed; 1 when one failed or did not finish; 2 when there is no runtime or
# GPU, or an option is wrong.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-runtime-env.sh "${1:-}"
shift || true
exec python3 -m tests.gpu_gate "${OUT:-gate-out}/gate" "$@"
