# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm kv-capacity`` with ``sliding_window=fp8`` plans what the engine
builds: Gemma 4 31B's sliding-window layers in FP8 beside TurboQuant full
layers, the same KV memory holding more tokens; refused where the engine
refuses it."""

import pytest

from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.v1.core import kv_cache_capacity as capacity

pytestmark = pytest.mark.cpu_test

TQ = "turboquant_3bit_nc"


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return write_full_size_config("Gemma-4-31B", tmp_path_factory.mktemp("g4"))


def plan(model_dir, *skip, **fields):
    """The plan of ``model_dir`` at 32K in 4 GiB with TurboQuant and ``skip``
    (language model only); ``fields`` override the request's."""
    request = dict(
        model=str(model_dir),
        max_model_len=32768,
        kv_cache_memory_bytes=4 << 30,
        kv_cache_dtype=TQ,
        kv_cache_dtype_skip_layers=skip,
        language_model_only=True,
    )
    report = capacity.plan_capacity(capacity.CapacityRequest(**(request | fields)))
    print(capacity.format_report(report))
    return report


def test_sliding_layers_planned_in_fp8(gemma4):
    bf16 = plan(gemma4, "boundary:0")
    fp8 = plan(gemma4, "boundary:0", "sliding_window=fp8")
    # The plan itself, not the backend lines: before per-layer backend
    # routing (0011) Gemma 4's forced TRITON_ATTN refuses TurboQuant layers.
    assert bf16.error is None and fp8.error is None, fp8.error
    sliding = bf16.layer_dtypes["auto"]
    assert fp8.layer_dtypes == {"fp8": sliding, TQ: bf16.layer_dtypes[TQ]}
    group = next(g for g in fp8.groups if g["type"] == "SlidingWindowSpec")
    assert group["dtype"] == "torch.uint8"
    # Half the bytes per sliding token: at 32K the same memory holds more
    # requests (the full layers' TurboQuant pages do not change).
    assert fp8.kv_tokens > 1.5 * bf16.kv_tokens


def test_refused_where_the_engine_refuses(tmp_path):
    qwen = write_full_size_config("Qwen3-4B", tmp_path / "q")
    report = plan(qwen, "sliding_window=fp8")
    assert report.fails
    assert "has no sliding-window layers, so the entry would change nothing" in (
        report.error
    )


@pytest.mark.parametrize(
    ("capability", "kv", "backend"),
    [
        ("9.0", "fp8", "FLASH_ATTN"),
        ("8.0", "fp8", "TRITON_ATTN"),
        ("9.0", "int8_per_token_head", "TRITON_ATTN"),
        ("9.0", "fp8_per_token_head", "TRITON_ATTN"),
    ],
    ids=["hopper-fa3", "ampere-fa2", "hopper-int8-per-token-head", "hopper-fp8-pth"],
)
def test_8bit_layers_get_the_backend_the_gpu_runs(tmp_path, capability, kv, backend):
    """An H200 ran Gemma 3's FP8 sliding layers on FLASH_ATTN (FA3 reads an
    FP8 cache); release 55's plan named TRITON_ATTN, because FlashAttention's
    checks asked the planning host's CPU platform. FA2 reads no FP8 cache.
    The per-token-head dtypes only Triton attention reads: 0.20.2's
    FlashAttention claimed them on SM 9.0, with no reader for their scales."""
    qwen = write_full_size_config("Qwen3-4B", tmp_path / "q")
    report = plan(
        qwen,
        max_model_len=8192,
        kv_cache_dtype=kv,
        device_capability=capability,
        language_model_only=False,
    )
    assert not report.fails, report.error or report.backend_errors
    assert set(report.attention_backends.values()) == {backend}


def test_sliding_layers_planned_per_token_head(gemma4):
    """``sliding_window=int8_per_token_head``: int8 pages that carry a
    4-byte scale per token and head, 260/256 of FP8's bytes per token."""
    fp8 = plan(gemma4, "boundary:0", "sliding_window=fp8")
    pth = plan(gemma4, "boundary:0", "sliding_window=int8_per_token_head")
    assert pth.error is None, pth.error
    assert pth.layer_dtypes == {
        "int8_per_token_head": fp8.layer_dtypes["fp8"],
        TQ: fp8.layer_dtypes[TQ],
    }

    def per_token(report):
        g = next(g for g in report.groups if g["type"] == "SlidingWindowSpec")
        return g, (g["page_size_bytes"] - g["padding_bytes"]) / g["block_size"]

    group, pth_bytes = per_token(pth)
    assert group["dtype"] == "torch.int8"
    assert pth_bytes * 256 == per_token(fp8)[1] * 260
    assert fp8.kv_tokens > pth.kv_tokens > 0.95 * fp8.kv_tokens
