#!/usr/bin/env bash
# One hybridkv lm-eval job end to end on a GPU with a tiny random-weight Qwen3.6-like
# hybrid (Gated DeltaNet + attention) and a locally built byte-level tokenizer: no hub,
# no weights (load_format=dummy). The scores are meaningless; what it shows is that the
# job runs: NIAH data built offline with the model's tokenizer, the baseline (KV auto)
# and candidate (turboquant_4bit_nc) engines each in their own process, and the
# tolerance comparison.
#   usage: bash .buildkite/lm-eval-harness/run-lm-eval-tiny-e2e.sh [RESULTS_DIR]
# Each engine's scores go to RESULTS_DIR (default: results-tiny beside this script) as
# JSON; the model and job config are written to a temporary folder (its path is printed).
# HYBRIDKV_TINY_MODEL=qwen3_next uses a tiny Qwen3-Next (GDN + attention + MoE) instead.
# Needs on PYTHONPATH (or installed): the patched vLLM, lm-eval 0.4.13 and what it
# imports; the repository root is added here for tests.models.tiny_hybrids.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
results=$(mkdir -p "${1:-$here/results-tiny}" && cd "${1:-$here/results-tiny}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/hybridkv-lm-eval-tiny.XXXXXX")
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn}

python3 - "$work" <<'PY'
import os
import sys
from pathlib import Path

from tests.models.tiny_hybrids import builders

out = Path(sys.argv[1])
name = os.environ.get("HYBRIDKV_TINY_MODEL", "qwen3_5_text")
model = getattr(builders, name)(out / f"tiny-{name}", mtp_layers=0, with_tokenizer=True)
# The Qwen3.5/3.6 checkpoints are multimodal; the text tasks need no vision tower.
mm = "  language_model_only: true\n" if name == "qwen3_5_text" else ""
(out / "tiny-TQ-4bit-nc.yaml").write_text(f"""\
# Tiny random-weight {name} model: KV turboquant_4bit_nc vs auto (pipeline check).
model_name: "{model}"
tasks:
- name: "hybridkv_niah"
  limit: 8
  metadata: {{context_length: 1024, num_samples: 8}}
  metrics:
  - name: "niah_recall,none"
max_model_len: 1024
kv_cache_dtype: turboquant_4bit_nc
enforce_eager: true
engine_args:
  load_format: dummy
{mm}  gpu_memory_utilization: 0.3
  # A fixed KV budget skips vLLM's memory profiling, which fails when other
  # processes on the GPU allocate or free memory meanwhile.
  kv_cache_memory_bytes: 268435456
baseline:
  kv_cache_dtype: auto
rtol: 0.08
atol: 0.0
""")
(out / "models-tiny.txt").write_text("tiny-TQ-4bit-nc.yaml\n")
print(f"wrote {model} and {out / 'tiny-TQ-4bit-nc.yaml'}")
PY

cat "$work/tiny-TQ-4bit-nc.yaml"

cd "$here"
python3 -m pytest -s -v test_lm_eval_correctness.py \
  --config-list-file="$work/models-tiny.txt" --tp-size=1 --results-dir="$results"
