# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Split-KV TurboQuant decode attention against a float64 reference.

Caches are packed from random indices, norms, scales and zeros by a small
PyTorch packer (every index pattern occurs), or filled by the store kernel
from random K/V (GPU tests). The reference decodes the packed bytes itself
(bit-packed indices, fp16 norms/scales/zeros, FP8 keys), checks that this
decoding gives back what was packed, and computes softmax attention in
float64. Outputs and scratch are poisoned with NaN before each call, so a row
or head the kernel skips shows up. Runs under the Triton CPU interpreter
(``HYBRIDKV_TRITON_INTERPRET=1``; fp32, small shapes) and natively on a GPU,
where the TF32 dots must still agree with float64 to fp32 rounding; the
``gpu`` tests add real shapes, bf16 queries and a CUDA-graph replay.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.attention.turboquant_packed import (
    PAGE,
    PRESETS,
    TOL,
    check_decode,
    decode,
    packed_case,
    poisoned,
    reference_attention,
    stored_cache,
    tables,
)
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops import turboquant_hadamard as hadamard
from vllm.v1.attention.ops.triton_turboquant_decode import (
    triton_turboquant_decode_attention,
)

# bf16 outputs: one bf16 ulp relative to max |out| (the Triton interpreter
# truncates to bf16, a GPU rounds to nearest).
BF16_TOL = 2**-7


# A padding row (0), one token, a partial tile, a page boundary, several tiles.
SEQ_LENS = [0, 1, 19, 45, 70]


@pytest.mark.parametrize("gqa", [1, 4, 6])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_head_dim_128(triton_device, preset, gqa):
    # Default split count from the shapes; 16 tokens minimum per split, so
    # the longer rows span several splits and the short ones leave some empty.
    check_decode(triton_device, preset, 128, gqa, SEQ_LENS)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_split_counts(triton_device, preset, splits):
    # One split writes the output directly; three merge partials, some empty.
    check_decode(triton_device, preset, 128, 4, [70, 5, 0], splits=splits)


@pytest.mark.parametrize("pad_bytes", [97, 96])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_padded_pages(triton_device, preset, pad_bytes):
    # Odd page size: slots at odd addresses, byte loads; even: 16-bit words.
    check_decode(
        triton_device, preset, 128, 6, [19, 45, 0], splits=2, pad_bytes=pad_bytes
    )


@pytest.mark.parametrize(
    ("head_dim", "gqa", "presets"),
    [
        (64, 6, PRESETS),
        (256, 8, ["turboquant_k8v4", "turboquant_k3v4_nc"]),
        (512, 2, ["turboquant_4bit_nc", "turboquant_3bit_nc"]),
    ],
)
def test_decode_other_head_dims(triton_device, head_dim, gqa, presets):
    for preset in presets:
        check_decode(
            triton_device, preset, head_dim, gqa, [3, 40], num_kv_heads=1, splits=2
        )


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_decode_verify_rows(triton_device, preset):
    """Rows as speculative verify builds them (patch 0008), with padding rows.

    One request's 1 + k query tokens are k + 1 rows sharing a block-table row
    with lengths L .. L + k; CUDA-graph padding rows have length 0.
    """
    L, k = 29, 3
    lens = [L + j for j in range(k + 1)] + [0, 0]
    check_decode(
        triton_device,
        preset,
        128,
        4,
        lens,
        table=lambda t: t[:1].expand(len(lens), -1),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_decode_hadamard_query(triton_device, preset, head_dim):
    """The backend's Hadamard rotation of the query in registers
    (``rotate_query``) against float64 ``q @ PiT``."""
    check_decode(triton_device, preset, head_dim, 4, SEQ_LENS, hadamard=True)


@pytest.mark.parametrize(
    ("head_dim", "gqa", "splits", "pad_bytes"),
    [
        (64, 6, None, 0),
        (128, 4, 1, 97),
        (128, 1, 3, 0),
        (256, 8, 2, 0),
        (512, 2, 2, 96),
    ],
)
def test_decode_pair_code(triton_device, head_dim, gqa, splits, pad_bytes):
    """3-bit keys coded by pairs (a pair codebook as the centroids): each
    pair of fields is one of 64 points, at every head size and split path."""
    check_decode(
        triton_device, "turboquant_3bit_nc", head_dim, gqa, SEQ_LENS, splits=splits,
        pad_bytes=pad_bytes, hadamard=True, pairs=True,
    )  # fmt: skip


def test_the_legacy_decode_refuses_pair_codes(triton_device, monkeypatch):
    """0.20.2's kernel reads every field as a level: refused, with the way out."""
    cfg, centroids, pit, cache, table = packed_case(
        "turboquant_3bit_nc", 64, [5], 1, triton_device, pairs=True
    )
    # The variable, not the module attribute: a pytest that restores a module
    # attribute it set leaves one that shadows vllm.envs' lookup for the
    # tests after this one.
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "legacy")
    with pytest.raises(
        ValueError,
        match="coded by pairs.*Unset VLLM_TURBOQUANT_DECODE=legacy.*3bit_nc",
    ):
        tq_decode.maybe_decode_attention(
            torch.randn(1, 2, 64).to(triton_device), cache, table,
            torch.tensor([5], dtype=torch.int32, device=triton_device), pit.T,
            centroids, 0.125, 3, cfg.key_packed_size, 3, norm_correction=True,
        )  # fmt: skip


def test_only_the_backends_own_matrix_counts_as_hadamard():
    h = _build_hadamard(64, "cpu")
    assert hadamard.is_backend_hadamard(h)
    assert hadamard.is_backend_hadamard(_build_hadamard(64, "cpu"))  # cached
    # Equal values but another tensor (or any other matrix): the GEMM path.
    assert not hadamard.is_backend_hadamard(h.clone())
    assert not hadamard.is_backend_hadamard(torch.linalg.qr(torch.randn(64, 64))[0])
    assert not hadamard.is_backend_hadamard(None)
    assert not hadamard.is_backend_hadamard(torch.eye(48))


def test_hadamard_lookup_builds_nothing_while_a_graph_is_captured(monkeypatch):
    """Building the matrix copies it to the GPU, which a CUDA graph capture
    forbids: during a capture only lookups made before count."""
    h = _build_hadamard(32, "cpu")
    built = []
    from vllm.v1.attention.backends import turboquant_attn

    real = turboquant_attn._build_hadamard
    monkeypatch.setattr(
        turboquant_attn, "_build_hadamard", lambda d, n: built.append(n) or real(d, n)
    )
    monkeypatch.setattr(hadamard, "_hadamard_ptrs", {})
    fake = SimpleNamespace(
        dim=h.dim, shape=h.shape, device=h.device, is_cuda=True, data_ptr=h.data_ptr
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not hadamard.is_backend_hadamard(fake)  # nothing looked up yet
    assert not built
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert hadamard.is_backend_hadamard(fake)  # a warm-up run looks it up
    assert built
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    built.clear()
    assert hadamard.is_backend_hadamard(fake)  # the capture reuses that lookup
    assert not built


def test_a_matrix_found_before_is_known_by_its_address(monkeypatch):
    """Once found, the backend's matrix is recognised without naming its
    device or asking whether a CUDA graph is captured: those were about half
    of the 4.6-5.6 µs ``is_backend_hadamard`` cost each decode on an H200
    host. Another matrix of that size is still looked up and refused."""
    h = _build_hadamard(32, "cpu")
    monkeypatch.setattr(hadamard, "_hadamard_ptrs", {})
    as_cuda = lambda t: SimpleNamespace(  # noqa: E731
        dim=t.dim, shape=t.shape, device=t.device, is_cuda=True, data_ptr=t.data_ptr
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert hadamard.is_backend_hadamard(as_cuda(h))  # looked up once

    def no_query():
        raise AssertionError("asked whether a graph is captured")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_query)
    assert hadamard.is_backend_hadamard(as_cuda(h))
    with pytest.raises(AssertionError, match="captured"):
        hadamard.is_backend_hadamard(as_cuda(h.clone()))
    # The same address read as another head size is not that matrix.
    assert not hadamard.is_backend_hadamard(h[:16, :16])


@pytest.mark.parametrize("own_matrix", [True, False])
def test_hook_rotates_in_registers_only_for_the_backend_matrix(
    triton_interpret, monkeypatch, own_matrix
):
    preset, D, Hk = "turboquant_4bit_nc", 64, 2
    lens = [21, 5]
    cfg, centroids, pit, cache, table = packed_case(preset, D, lens, Hk, "cpu")
    if own_matrix:
        pit = _build_hadamard(D, "cpu")
    rotated = []
    real = tq_decode.rotate_query

    def spy(query, PiT, key_scale=None):
        rotated.append(PiT)
        return real(query, PiT, key_scale)

    monkeypatch.setattr(tq_decode, "rotate_query", spy)
    query = torch.randn(len(lens), 4 * Hk, D)
    out = tq_decode.maybe_decode_attention(
        query,
        cache,
        table,
        torch.tensor(lens, dtype=torch.int32),
        pit,
        centroids,
        D**-0.5,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.effective_value_quant_bits,
        norm_correction=cfg.norm_correction,
        PiT=pit,
    )
    assert len(rotated) == (1 if own_matrix else 0)
    ref = reference_attention(query, cache, table, lens, cfg, centroids, pit, D**-0.5)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL


def test_split_count_ignores_sequence_lengths():
    # CUDA graphs replay one launch for every sequence length: the split count
    # depends on the batch shape and the device only (here 132 SMs, cap 32).
    assert tq_decode.num_kv_splits(1, 8, 32, 132) == 32
    assert tq_decode.num_kv_splits(16, 8, 32, 132) == 9
    assert tq_decode.num_kv_splits(16, 4, 32, 132) == 17
    assert tq_decode.num_kv_splits(64, 8, 32, 132) == 3
    assert tq_decode.num_kv_splits(512, 8, 32, 132) == 1
    assert tq_decode.num_kv_splits(1, 8, 4, 132) == 4


def test_gluon_split_count_fills_whole_waves():
    # 132 SMs x 8 resident warps: 1,056 one-warp programs per wave (head_dim
    # 128), 528 two-warp ones (256), 264 four-warp ones (512).
    n = tq_decode.gluon_num_splits
    assert n(16, 8, 1, 132, 128, 8) == 8  # 1,024 programs, one wave; 17 took 3
    assert n(1, 8, 1, 132, 128, 8) == 128  # the cap
    assert n(1, 8, 1, 132, 32, 8) == 32
    assert n(64, 8, 1, 132, 128, 8) == 2
    assert n(16, 4, 2, 132, 64, 8) == 8
    assert n(4, 4, 4, 132, 32, 8) == 16
    assert n(16, 4, 4, 132, 32, 8) == 4
    # 600 programs: four waves of a seventh of the context beat one of all.
    assert n(75, 8, 1, 132, 128, 8) == 7
    assert n(256, 8, 1, 132, 128, 8) == 1
    # 12 resident warps (the Gluon stage 1's register cap): 1,584 one-warp
    # programs a wave.
    assert n(16, 8, 1, 132, 128, 12) == 12  # 1,536 programs, one wave
    assert n(64, 8, 1, 132, 128, 12) == 3
    assert n(16, 4, 2, 132, 64, 12) == 12


def test_gluon_split_count_does_not_split_a_full_batch():
    # From 1.5 waves of one program per (row, KV head) rows are short (the KV
    # cache bounds rows x context) and a split costs about what its tokens
    # do: 500 x 576 on Qwen3-4B took 209 / 290 us at one split and 364 / 531
    # us at the 5 the wave model alone chose (k8v4 / 4bit_nc, H100).
    n = tq_decode.gluon_num_splits
    assert n(500, 8, 1, 132, 32, 8) == 1
    assert n(300, 8, 1, 132, 32, 8) == 1
    assert n(198, 8, 1, 132, 32, 8) == 1  # 1,584 programs: 1.5 waves of 1,056
    assert n(500, 4, 2, 132, 32, 8) == 1  # Qwen3.6-27B: 528 two-warp slots
    # Below it the wave model still splits: 160 x 8192 (1.2 waves) took
    # 1,189 us at one split and 879 at 9.
    assert n(197, 8, 1, 132, 32, 8) == 2
    assert n(160, 8, 1, 132, 32, 8) == 9
    assert n(140, 8, 1, 132, 32, 8) == 16


def test_scratch_holds_more_splits_in_its_spare_rows():
    buf = torch.empty(8, 4, 32, 129)  # the backend's shape: 8 rows x 32 splits
    assert tq_decode.scratch_splits(buf, 8, 4, 128) == 32
    assert tq_decode.scratch_splits(buf, 1, 4, 128) == 256
    view = tq_decode.scratch_view(buf, 1, 4, 128, 128)
    assert view.shape == (1, 4, 128, 129)
    assert view.data_ptr() == buf.data_ptr()
    assert tq_decode.scratch_view(buf, 2, 4, 16, 128) is buf
    # Not contiguous: only its own split dimension counts.
    assert tq_decode.scratch_splits(buf[:, :, :16], 1, 4, 128) == 16
    assert tq_decode.scratch_splits(buf.half(), 1, 4, 128) == 0
    assert tq_decode.scratch_splits(None, 1, 4, 128) == 0


def test_decode_stage_names_a_kernel_or_says_which_exist(monkeypatch):
    import vllm.envs as envs

    def stage():
        return envs.VLLM_TURBOQUANT_DECODE

    monkeypatch.delenv("VLLM_TURBOQUANT_DECODE", raising=False)
    assert stage() == "gluon"  # the default
    for name in ("triton", "legacy"):
        monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", name)
        assert stage() == name
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "fast")
    with pytest.raises(ValueError, match=r"'fast' for VLLM_TURBOQUANT_DECODE.*gluon"):
        stage()


def test_serves_every_supported_layout():
    for d in (64, 128, 256, 512):
        for gqa in range(1, 9):
            for bits, fp8 in ((4, False), (3, False), (0, True)):
                assert tq_decode.supports(d, 4 * gqa, 4, bits, 4, fp8)
    assert not tq_decode.supports(96, 8, 2, 4, 4, False)
    assert not tq_decode.supports(128, 32, 2, 4, 4, False)  # GQA 16: 0.20.2's


@pytest.mark.parametrize("enabled", [True, False])
def test_backend_decode_routes_here(triton_interpret, monkeypatch, enabled):
    """``TurboQuantAttentionImpl._decode_attention`` reaches this kernel
    (through 0.20.2's entry point, which it hooks), on the verify rows'
    lengths and block table, with the layer's shared scratch;
    ``VLLM_TURBOQUANT_DECODE=legacy`` keeps 0.20.2's kernel."""
    from vllm.v1.attention.backends import turboquant_attn

    preset, D, gqa, Hk = "turboquant_4bit_nc", 64, 4, 2
    lens = [21, 22, 0]
    cfg, centroids, pit, cache, table = packed_case(preset, D, lens, Hk, "cpu")
    calls = []
    real = tq_decode.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mid_o_buf"))
        return real(*args, **kwargs)

    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "gluon" if enabled else "legacy")
    monkeypatch.setattr(tq_decode, "decode_attention", spy)
    impl = object.__new__(turboquant_attn.TurboQuantAttentionImpl)
    impl.scale, impl.tq_config, impl.max_num_kv_splits = D**-0.5, cfg, 8
    impl._tq_rotates_values = False  # packed_case packs values as they are
    Hq = gqa * Hk
    layer = torch.nn.Module()
    layer._tq_mid_o_buf = poisoned((4, Hq, 8, D + 1), "cpu")
    layer._tq_output_buf = poisoned((4, Hq, D), "cpu")
    layer._tq_lse_buf = poisoned((4, Hq), "cpu")
    meta = SimpleNamespace(
        block_table=table[:1],  # per request; the verify rows have their own
        seq_lens=torch.tensor([22], dtype=torch.int32),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        decode_block_table=table[:1].expand(len(lens), -1),
    )
    query = torch.randn(len(lens), Hq, D)
    out = impl._decode_attention(
        query, cache, meta, pit.T.contiguous(), centroids, pit, layer
    )
    if enabled:
        assert len(calls) == 1 and calls[0] is layer._tq_mid_o_buf
    else:
        assert not calls
    ref = reference_attention(
        query, cache, meta.decode_block_table, lens, cfg, centroids, pit, D**-0.5
    )
    got = out.double()
    assert not got[:2].isnan().any()
    err = (got[:2] - ref[:2]).abs().max().item() / ref.abs().max().item()
    assert err < TOL
    if enabled:
        assert torch.equal(got[2], ref[2])  # padding row: zeros, not NaN


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
@pytest.mark.parametrize("pad_bytes", [0, 97])
def test_each_packed_byte_is_read_once(
    triton_interpret, monkeypatch, preset, pad_bytes
):
    """Every byte of every slot in context is loaded exactly once per call.

    Counts the interpreter's loads that land in the cache: a kernel that
    fetches a slot once per query head of the group, or prefetches past a
    split's end, loads bytes twice or outside the context.
    """
    import numpy as np
    from triton.runtime import interpreter

    D, Hk, gqa, lens = 64, 2, 4, [20, 37, 0]
    cfg, centroids, pit, cache, table = packed_case(
        preset, D, lens, Hk, "cpu", pad_bytes
    )
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    base, size = flat.data_ptr(), flat.numel()
    counts = np.zeros(size, dtype=np.int64)
    load = interpreter.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, *args, **kwargs):
        addr = ptrs.data.astype(np.int64).ravel()
        on = np.broadcast_to(mask.data, ptrs.data.shape).ravel()
        hit = on & (addr >= base) & (addr < base + size)
        for byte in range(ptrs.get_element_ty().primitive_bitwidth // 8):
            np.add.at(counts, addr[hit] - base + byte, 1)
        return load(self, ptrs, mask, *args, **kwargs)

    monkeypatch.setattr(
        interpreter.InterpreterBuilder, "create_masked_load", counting_load
    )
    Hq = gqa * Hk
    decode(
        torch.randn(len(lens), Hq, D),
        cache,
        table,
        torch.tensor(lens, dtype=torch.int32),
        cfg,
        centroids,
        pit,
        num_splits=3,
        min_split_tokens=16,
    )
    expected = np.zeros(size, dtype=np.int64)
    slot_offs = torch.arange(cfg.slot_size)
    for row, n in enumerate(lens):
        for p in range(n):
            blk = int(table[row, p // PAGE])
            for h in range(Hk):
                start = blk * cache.stride(0) + (p % PAGE) * cache.stride(1)
                start += h * cache.stride(2)
                expected[(start + slot_offs).numpy()] += 1
    assert counts.max() == 1, (
        f"slot bytes loaded up to {counts.max()} times in one call (GQA {gqa}); "
        "the packed cache should be read once"
    )
    assert np.array_equal(counts, expected), "loaded bytes differ from the context"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "shape",
    [
        (32, 8, 128, [1, 700, 4100, 8192, 0]),
        (24, 4, 256, [33, 3000, 8192, 0]),
        (16, 2, 512, [5, 2100, 0]),
    ],
    ids=["qwen3-4b", "qwen3.6-27b", "d512"],
)
def test_decode_real_shapes_gpu(preset, shape):
    """Real head counts and contexts, bf16 queries as the backend passes them."""
    Hq, Hk, D, seq_lens = shape
    device = "cuda"
    torch.manual_seed(3)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints, pit = tables(cfg, D, device)
    cache, table = stored_cache(cfg, seq_lens, Hk, D, device, pit, midpoints)
    query = torch.randn(len(seq_lens), Hq, D, device=device).to(torch.bfloat16)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    B = len(seq_lens)
    out = decode(
        query,
        cache,
        table,
        seq_t,
        cfg,
        centroids,
        pit,
        mid_o_buf=poisoned((B, Hq, 32, D + 1), device),
        output_buf=poisoned((B, Hq, D), device, torch.bfloat16),
    )
    torch.accelerator.synchronize()
    ref = reference_attention(
        query.float(), cache, table, seq_lens, cfg, centroids, pit, D**-0.5
    )
    got = out.double().cpu()
    assert out.dtype == torch.bfloat16 and not got.isnan().any()
    # One bf16 ulp (2**-7 of max |out|) bounds the error here, not the kernel.
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < BF16_TOL, f"max error {err:.3g} relative to max |out|"
    # The same launch with an fp32 output holds fp32 rounding (split TF32).
    out32 = decode(
        query,
        cache,
        table,
        seq_t,
        cfg,
        centroids,
        pit,
        output_buf=poisoned((B, Hq, D), device),
        out_dtype=torch.float32,
    )
    torch.accelerator.synchronize()
    err32 = (out32.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err32 < TOL, f"fp32 output: max error {err32:.3g} relative to max |out|"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_cuda_graph_replay_follows_new_lengths(preset):
    """A graph captured once serves other sequence lengths and queries.

    The split count is fixed at capture from the batch shape; every replay
    must follow the new lengths (float64 reference), not the captured ones.
    """
    Hq, Hk, D, B, ctx = 32, 8, 128, 4, 4096
    device = "cuda"
    torch.manual_seed(5)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints, pit = tables(cfg, D, device)
    cache, table = stored_cache(cfg, [ctx] * B, Hk, D, device, pit, midpoints)
    query = torch.randn(B, Hq, D, device=device).to(torch.bfloat16)
    seq_t = torch.tensor([100, 2000, 5, ctx], dtype=torch.int32, device=device)
    mid = poisoned((B, Hq, 32, D + 1), device)

    def call():
        return decode(query, cache, table, seq_t, cfg, centroids, pit, mid_o_buf=mid)

    call()  # compile outside the capture
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = call()
    for lens in ([ctx, 1, 3000, 0], [7, ctx, 16, 1000]):
        seq_t.copy_(torch.tensor(lens, dtype=torch.int32))
        query.copy_(torch.randn(B, Hq, D, device=device))
        graph.replay()
        torch.accelerator.synchronize()
        replayed = graph_out.clone()
        eager = call().float()
        assert (replayed.float() - eager).abs().max() <= 8e-3 * eager.abs().max()
        ref = reference_attention(
            query.float(), cache, table, lens, cfg, centroids, pit, D**-0.5
        )
        err = (replayed.double().cpu() - ref).abs().max() / ref.abs().max()
        err = err.item()
        assert err < BF16_TOL, f"replay with lengths {lens}: max error {err:.3g}"


def test_decode_writes_into_the_callers_rows(triton_device):
    """0.20.2's entry point hands its ``output_buf`` on: rows of a layer's
    output, [tokens, Hq * D] viewed as [B, Hq, D], receive the result in
    place, and the rows past B keep what they held."""
    preset, D, gqa, Hk = "turboquant_4bit_nc", 64, 4, 2
    lens = [19, 45, 3]
    cfg, centroids, pit, cache, table = packed_case(preset, D, lens, Hk, triton_device)
    B, Hq = len(lens), gqa * Hk
    query = torch.randn(B, Hq, D).to(triton_device)
    layer_out = poisoned((B + 2, Hq * D), triton_device)
    rows = layer_out[:B].view(B, Hq, D)
    out = triton_turboquant_decode_attention(
        query, cache, table, torch.tensor(lens, dtype=torch.int32).to(rows.device),
        pit.T.contiguous(), centroids, D**-0.5, cfg.key_mse_bits,
        cfg.key_packed_size, cfg.effective_value_quant_bits,
        norm_correction=cfg.norm_correction, PiT=pit, output_buf=rows,
    )  # fmt: skip
    assert out.data_ptr() == rows.data_ptr(), "the result was not written in place"
    ref = reference_attention(query, cache, table, lens, cfg, centroids, pit, D**-0.5)
    err = (rows.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL
    assert layer_out[B:].isnan().all()


def test_sm_counts_are_kept_per_device_type(monkeypatch):
    """A decode on CPU tensors (the interpreter's) and one on ``cuda:0`` ask
    for the SM count of devices whose index reads 0 alike: the CPU figure
    must not stand in for the GPU's, or its split count shrinks (6 splits
    where 128 were due, in a GPU test session run after a CPU-tensor test)."""
    from types import SimpleNamespace

    from vllm.v1.attention.ops import turboquant_device

    monkeypatch.setattr(turboquant_device, "_sm_counts", {})
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: SimpleNamespace(multi_processor_count=132),
    )
    assert turboquant_device.num_sms(torch.device("cpu")) == 4
    assert turboquant_device.num_sms(torch.device("cuda", 0)) == 132
    assert turboquant_device.num_sms(torch.device("cuda")) == 132
