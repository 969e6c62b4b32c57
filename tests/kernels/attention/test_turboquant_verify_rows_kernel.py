# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verify rows through the real TurboQuant store and decode kernels.

A speculative verify batch (1 + k tokens per request, cached context before
them) computed through the metadata builder and ``forward`` must equal, row
for row and bit for bit, the same tokens computed one decode step at a time,
which is what a run without speculation does; and both must match a float64
attention over the dequantized cache with each row's causal length. Runs
under the Triton CPU interpreter in CI (``HYBRIDKV_TRITON_INTERPRET=1``) and
natively on a GPU.
"""

import math

import pytest
import torch

from tests.v1.attention.test_turboquant_verify_rows import (
    Runner,
    _vllm_config,
    no_host_sync,
)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.triton_utils import triton
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionImpl,
    TurboQuantMetadata,
    TurboQuantMetadataBuilder,
    _build_hadamard,
)
from vllm.v1.attention.ops.triton_turboquant_decode import (
    _tq_full_dequant_kv,
    _use_fp8_e4b15,
)

HQ, HK, D, BLOCK, NUM_BLOCKS, K = 4, 2, 64, 16, 8, 3
SEQ_LENS = [37, 21]  # cached context + the 1 + K new tokens of each request
TABLES = [[3, 1, 6, 0], [5, 2, 0, 0]]


def _setup(preset: str, device: str):
    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(
            num_heads=HQ,
            head_size=D,
            scale=D**-0.5,
            num_kv_heads=HK,
            kv_cache_dtype=preset,
        )
    impl.max_num_kv_splits = 4  # few programs under the interpreter
    layer = torch.nn.Module()
    layer._tq_centroids = (
        get_centroids(D, impl.tq_config.centroid_bits).float().to(device)
    )
    impl._ensure_on_device(layer, torch.device(device))
    slot = impl.tq_config.slot_size_aligned
    cache = torch.zeros(NUM_BLOCKS, BLOCK, HK, slot, dtype=torch.uint8, device=device)
    return impl, layer, cache


def _slots(req: int, positions) -> list[int]:
    return [TABLES[req][p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def _fill_cache(impl, layer, cache, device):
    """Store every token of both requests, as do_kv_cache_update does."""
    g = torch.Generator().manual_seed(0)
    slots = sum((_slots(r, range(s)) for r, s in enumerate(SEQ_LENS)), [])
    n = len(slots)
    k = torch.randn(n, HK, D, generator=g).to(device)
    v = torch.randn(n, HK, D, generator=g).to(device)
    impl._store_kv(
        k, v, cache, torch.tensor(slots, dtype=torch.int64, device=device), layer
    )


def _cam(q_lens, seq_lens, device, tables=TABLES):
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    n = int(cu[-1])
    return CommonAttentionMetadata(
        query_start_loc=cu.to(device),
        query_start_loc_cpu=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(q_lens),
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device),
        is_prefilling=torch.zeros(len(q_lens), dtype=torch.bool),
    )


def _forward(impl, layer, cache, meta, q):
    out = torch.full((q.shape[0], HQ * D), float("nan"), device=q.device)
    kv = torch.zeros(q.shape[0], HK * D, device=q.device)
    return impl.forward(layer, q, kv, kv, cache, meta, output=out).view(-1, HQ, D)


def _dequantized(impl, layer, cache, req: int, length: int):
    """(length, HK, D) keys and values read back from the cache, float64."""
    device = cache.device
    alloc = math.ceil(length / BLOCK) * BLOCK
    k_buf = torch.zeros(1, HK, alloc, D, dtype=torch.float16, device=device)
    v_buf = torch.zeros_like(k_buf)
    bt = torch.tensor([TABLES[req]], dtype=torch.int32, device=device)
    cfg = impl.tq_config
    _tq_full_dequant_kv[(alloc, HK)](
        cache,
        bt,
        layer._tq_centroids,
        k_buf,
        v_buf,
        k_buf.stride(0),
        k_buf.stride(1),
        k_buf.stride(2),
        v_buf.stride(0),
        v_buf.stride(1),
        v_buf.stride(2),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        bt.stride(0),
        HEAD_DIM=D,
        BLOCK_SIZE=BLOCK,
        NUM_KV_HEADS=HK,
        MSE_BYTES=impl._mse_bytes,
        KPS=cfg.key_packed_size,
        VQB=cfg.effective_value_quant_bits,
        VAL_DATA_BYTES=impl._val_data_bytes,
        MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=1 if cfg.key_fp8 else 0,
        BLOCK_D=triton.next_power_of_2(D),
        NORM_CORRECTION=1 if cfg.norm_correction else 0,
        FP8_E4B15=_use_fp8_e4b15(0),
        num_warps=4,
    )
    k = k_buf[0, :, :length].double()
    v = v_buf[0, :, :length].double()
    if not cfg.key_fp8:
        k = k @ _build_hadamard(D, str(device)).double()
    # A layer that stores its values rotated (turboquant.value_rotation)
    # records so on its impl when it first stores.
    if getattr(impl, "_tq_rotates_values", False):
        v = v @ _build_hadamard(D, str(device)).double()
    return k.transpose(0, 1), v.transpose(0, 1)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_verify_rows_equal_sequential_decodes_and_reference(
    preset, triton_device, monkeypatch
):
    device = triton_device
    impl, layer, cache = _setup(preset, device)
    _fill_cache(impl, layer, cache, device)
    q_lens = [1 + K] * len(SEQ_LENS)
    q = torch.randn(sum(q_lens), HQ * D, generator=torch.Generator().manual_seed(1))
    q = q.to(device)

    # As under a FULL CUDA graph: metadata built for capture (seq_len ==
    # query_len, max_seq_len == max_model_len), then the runner's tensors and
    # the builder's buffers are rewritten in place for the real step, and the
    # forward decided at capture runs without reading anything on the host.
    runner = Runner(device=device, width=len(TABLES[0]))
    builder = TurboQuantMetadataBuilder(
        None, ["l"], _vllm_config(K), torch.device(device)
    )
    captured = builder.build_for_cudagraph_capture(
        runner.step(q_lens, q_lens, tables=TABLES, max_seq_len=4096)
    )
    builder.build(0, runner.step(q_lens, SEQ_LENS, tables=TABLES))
    with no_host_sync(monkeypatch):
        verify = _forward(impl, layer, cache, captured, q)

    # The same tokens as plain single-token decode steps (no speculation).
    plain = TurboQuantMetadataBuilder(
        None, ["l"], _vllm_config(None), torch.device(device)
    )
    rows, i = [], 0
    for r, s in enumerate(SEQ_LENS):
        for j in range(1 + K):
            cam = _cam([1], [s - K + j], device, tables=[TABLES[r]])
            rows.append(_forward(impl, layer, cache, plain.build(0, cam), q[i : i + 1]))
            i += 1
    sequential = torch.cat(rows)
    assert torch.equal(verify, sequential), "verify rows differ from plain decodes"

    assert _max_reference_error(impl, layer, cache, q, verify) < 2e-3


def _max_reference_error(impl, layer, cache, q, out) -> float:
    worst, i = 0.0, 0
    for r, s in enumerate(SEQ_LENS[: out.shape[0] // (1 + K)]):
        k_all, v_all = _dequantized(impl, layer, cache, r, s)
        for j in range(1 + K):
            n = s - K + j  # row j sees its own and earlier tokens only
            qh = q[i].view(HQ, D).double()
            kh = k_all[:n].repeat_interleave(HQ // HK, dim=1)  # (n, HQ, D)
            vh = v_all[:n].repeat_interleave(HQ // HK, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", qh, kh) * D**-0.5, dim=-1)
            ref = torch.einsum("hn,nhd->hd", p, vh)
            worst = max(worst, float((out[i].double() - ref).norm() / ref.norm()))
            i += 1
    return worst


def test_reference_catches_rows_that_are_not_causal(triton_device):
    """The check above can fail: verify rows that all see every new token
    (no causal mask inside the verify chunk) are caught."""
    device = triton_device
    impl, layer, cache = _setup("turboquant_4bit_nc", device)
    _fill_cache(impl, layer, cache, device)
    builder = TurboQuantMetadataBuilder(
        None, ["l"], _vllm_config(K), torch.device(device)
    )
    meta: TurboQuantMetadata = builder.build(0, _cam([1 + K], SEQ_LENS[:1], device))
    q = torch.randn(1 + K, HQ * D, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    assert (
        _max_reference_error(
            impl, layer, cache, q, _forward(impl, layer, cache, meta, q)
        )
        < 2e-3
    )
    meta.decode_seq_lens.fill_(SEQ_LENS[0])
    bad = _forward(impl, layer, cache, meta, q)
    assert _max_reference_error(impl, layer, cache, q, bad) > 2e-2
