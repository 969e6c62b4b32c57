# Sourced by scripts/gpu-suite.sh and scripts/gpu-gate.sh on the GPU host: checks that
# PREFIX ($1, default /opt/hkv) holds the runtime ../shared/gpu-runtime/unpack.sh
# unpacks, and points Python, the vllm command and the compile caches at it.
prefix=${1:-/opt/hkv}
if [ ! -f "$prefix/site/vllm/__init__.py" ]; then
  echo "$(basename "$0" .sh): no vLLM runtime under $prefix (expected $prefix/site/vllm," \
    "where ../shared/gpu-runtime/unpack.sh PREFIX puts it); unpack the runtime there" \
    "first, or pass its PREFIX as the first argument" >&2
  exit 2
fi
export PYTHONPATH="$prefix/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Triton and torch.compile caches on the host's disk, shared by every engine and
# reused by later commands.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hkv-cache/triton}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/hkv-cache/vllm}
