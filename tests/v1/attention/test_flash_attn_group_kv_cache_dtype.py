# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FA3's ahead-of-time schedule is computed for the KV dtype its own group's
layers store, not the run's ``cache_dtype``.

0.20.2 asks ``get_scheduler_metadata`` for the run's dtype when that is FP8
and for the group's spec dtype otherwise. With per-layer KV dtypes both are
wrong for some group: FP8 sliding-window layers in a TurboQuant run
(``sliding_window=fp8``) were scheduled as uint8, their spec's storage dtype,
and FA3 stopped at the first step ("FlashAttention only supports fp16, bf16,
and fp8_e4m3 data type", Gemma 3 on an H200); model-dtype layers kept by a
skip list in an FP8 run were scheduled as FP8.

FlashAttention also claims no per-token-head KV dtype: 0.20.2 accepted
``int8_per_token_head`` and ``fp8_per_token_head`` wherever FA3 reads FP8, so
on SM 9.0 those layers (a whole run's, or ``sliding_window=int8_per_token_head``
in a TurboQuant run) went to FlashAttention, which has no reader for their
per-token scales. Triton attention, the backend that has one, serves them.
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec

pytestmark = pytest.mark.cpu_test


def import_flash_attn(monkeypatch):
    """vLLM's FlashAttention backend module on a host without vLLM's kernels."""
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    from vllm.v1.attention.backends import flash_attn

    return flash_attn


@pytest.fixture
def flash_attn(monkeypatch):
    return import_flash_attn(monkeypatch)


def attention_layer(impl_cls, sliding_window, kv_cache_dtype="auto"):
    """An ``Attention`` layer as a metadata builder reads it, without weights."""
    layer = Attention.__new__(Attention)
    impl = impl_cls.__new__(impl_cls)
    impl.sliding_window = sliding_window
    object.__setattr__(layer, "impl", impl)
    object.__setattr__(layer, "kv_cache_dtype", kv_cache_dtype)
    return layer


def _scheduled_dtype(flash_attn, monkeypatch, tmp_path, run_dtype, layer_dtype):
    from tests.models.tiny_hybrids import builders
    from vllm.engine.arg_utils import EngineArgs

    path = builders.qwen3_dense(tmp_path / "qwen3")
    config = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=1024,
        kv_cache_dtype="turboquant_3bit_nc",
    ).create_engine_config()
    # The run's dtype as the builder reads it (an FP8 engine cannot be
    # configured on the CPU platform).
    config.cache_config.cache_dtype = run_dtype
    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
    context = config.compilation_config.static_forward_context
    for name in names:
        context[name] = attention_layer(
            flash_attn.FlashAttentionImpl, (511, 0), layer_dtype
        )
    other = "model.layers.2.self_attn.attn"
    context[other] = attention_layer(flash_attn.FlashAttentionImpl, (511, 0), run_dtype)

    seen = []

    def get_scheduler_metadata(**kwargs):
        seen.append(kwargs["qkv_dtype"])
        return None

    # Imported only where FlashAttention is built (not on the CPU platform).
    monkeypatch.setattr(
        flash_attn, "get_scheduler_metadata", get_scheduler_metadata, raising=False
    )
    hf = config.model_config.hf_text_config
    storage = torch.uint8 if layer_dtype.startswith("fp8") else torch.bfloat16
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=hf.num_key_value_heads,
        head_size=config.model_config.get_head_size(),
        dtype=storage,
    )
    builder = flash_attn.FlashAttentionMetadataBuilder(
        spec, names, config, torch.device("cpu")
    )
    builder.aot_schedule = True
    common = SimpleNamespace(
        num_reqs=1,
        num_actual_tokens=4,
        max_query_len=4,
        max_seq_len=4,
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([4], dtype=torch.int32),
        block_table_tensor=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(4),
        causal=True,
    )
    builder.build(0, common)
    builder.build(0, common)
    return seen


@pytest.mark.parametrize(
    ("run_dtype", "layer_dtype", "expected"),
    [
        ("turboquant_3bit_nc", "fp8", torch.float8_e4m3fn),
        ("fp8", "auto", torch.bfloat16),
        ("turboquant_3bit_nc", "auto", torch.bfloat16),
        ("fp8_e4m3", "fp8_e4m3", torch.float8_e4m3fn),
    ],
    ids=["fp8-layers-in-turboquant-run", "bf16-layers-in-fp8-run", "auto", "fp8"],
)
def test_schedule_uses_the_groups_kv_dtype(
    flash_attn, monkeypatch, tmp_path, run_dtype, layer_dtype, expected
):
    seen = _scheduled_dtype(flash_attn, monkeypatch, tmp_path, run_dtype, layer_dtype)
    assert seen == [expected, expected]


@pytest.mark.parametrize(
    "kv_cache_dtype", ["int8_per_token_head", "fp8_per_token_head"]
)
def test_flash_attention_claims_no_per_token_head_dtype(
    flash_attn, monkeypatch, kv_cache_dtype
):
    # As on SM 9.0 with FA3, where FlashAttention reads an FP8 cache.
    monkeypatch.setattr(flash_attn, "flash_attn_supports_fp8", lambda: True)
    backend = flash_attn.FlashAttentionBackend
    assert backend.supports_kv_cache_dtype("fp8")
    assert not backend.supports_kv_cache_dtype(kv_cache_dtype)


def _tiny_gemma3(path):
    from transformers import Gemma3TextConfig

    from tests.models.tiny_hybrids.tokenizer import (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        TINY_VOCAB_SIZE,
    )

    # Gemma 3's layout: 5 sliding-window layers to 1 full, head_dim 256.
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=64,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["Gemma3ForCausalLM"],
    )
    config.save_pretrained(path)
    return path


def _layer_dtypes(worker):
    from vllm.model_executor.layers.attention.attention import Attention as Layer

    model = worker.model_runner.model
    return {
        name: module.kv_cache_dtype
        for name, module in model.named_modules()
        if isinstance(module, Layer)
    }


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_dtype", ["fp8", "int8_per_token_head"])
def test_8bit_sliding_layers_beside_turboquant_serve(
    tmp_path, monkeypatch, sliding_dtype
):
    """An engine with TurboQuant full layers and 8-bit sliding-window layers
    (``sliding_window=fp8``, on FlashAttention; ``int8_per_token_head``, on
    Triton attention) serves prompts longer than the window; before the fix
    FA3's first schedule of the FP8 group raised."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from vllm import LLM, SamplingParams

    # collective_rpc sends _layer_dtypes (a function) to the engine process.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    llm = LLM(
        model=str(_tiny_gemma3(tmp_path / "gemma3")),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=1024,
        kv_cache_memory_bytes=128 * 2**20,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        dtype="bfloat16",
        kv_cache_dtype="turboquant_3bit_nc",
        kv_cache_dtype_skip_layers=["boundary:0", f"sliding_window={sliding_dtype}"],
        seed=0,
    )
    (dtypes,) = llm.collective_rpc(_layer_dtypes)
    assert set(dtypes.values()) == {sliding_dtype, "turboquant_3bit_nc"}, dtypes
    # One prompt inside the 64-token window, one well past it.
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (40, 300)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    )
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 8
        for step in completion.logprobs:
            assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in step.values())
