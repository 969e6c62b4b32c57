# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: the tiny fixtures boot vLLM's engine (dummy weights) and generate.

Run on the GPU host by scripts/gpu-suite.sh; skipped on CPU. Gemma 4 is not
here yet: vLLM 0.20.2 cannot parse Gemma 4 configs with transformers >= 5.15
(see test_tiny_configs.py).
"""

import pytest

from .builders import qwen3_5_text, qwen3_dense, qwen3_next

# No --gdn-prefill-backend: the GPU runtime has no flashinfer, and on SM90
# pristine 0.20.2's "auto" picks FlashInfer anyway (ModuleNotFoundError at the
# first prefill); patch 0003 makes it check first.
MODELS = {
    "qwen3_dense": (qwen3_dense, {}),
    "qwen3_next": (qwen3_next, {}),
    "qwen3_5_text": (qwen3_5_text, {"language_model_only": True}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_boots_and_generates(name, tmp_path):
    from .spec_decode_matrix import child_env, spawn

    builder, extra = MODELS[name]
    model = builder(tmp_path / name)
    engine = dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        # A fixed KV budget: engines of other tests may share the GPU, and a
        # memory profile would count their allocations as this one's.
        kv_cache_memory_bytes=256 * 2**20,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        # The child reads the engine's counters (LLM.get_metrics).
        disable_log_stats=False,
        seed=0,
        **extra,
    )
    prompts = [list(range(10 + i, 42 + i)) for i in range(4)]
    # Its own process, ended without the engine's teardown: several engines
    # torn down in one pytest process hung on the H100.
    rec = spawn(
        name,
        {"engine": engine, "prompts": prompts, "max_tokens": 24},
        tmp_path,
        timeout=240,
        env=child_env(tmp_path, None, num_spec=0),
    )
    assert "crash" not in rec, f"{rec['crash']} (log: {tmp_path / 'logs'})"
    lengths = [len(o) for o in rec["outputs"]]
    print(f"{name}: generated {lengths} tokens; first: {rec['outputs'][0][:8]}")
    assert lengths == [24] * 4
