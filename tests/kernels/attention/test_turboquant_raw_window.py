# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A TurboQuant decode whose last ``W`` positions come from a raw window.

``decode_attention(..., raw_window=RawWindow(...))`` attends to a row's
positions ``[0, L - W)`` through the packed cache and to ``[L - W, L)``
through the twin's model-dtype cache (``turboquant.raw_window``), the window
merged as one more split. Checked against float64 attention over exactly
those slots; twin slots outside each row's window hold NaN, so a read of one
shows. Runs under the Triton CPU interpreter (``HYBRIDKV_TRITON_INTERPRET=1``;
the Gluon stage 1 on NumPy) and natively on a GPU.
"""

import math

import pytest
import torch

from tests.kernels.attention.test_turboquant_decode_gluon import (
    gluon_on_numpy,  # noqa: F401 (fixture)
)
from tests.kernels.attention.turboquant_packed import (
    PAGE,
    TOL,
    decode,
    dequantize,
    packed_case,
    poisoned,
)
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops.triton_turboquant_raw_window import RawWindow

W = 16
TWIN_PAGE = 8  # another block size than the packed cache's
# Longer than, shorter than and equal to the window, one past it, and a
# CUDA-graph padding row.
SEQ_LENS = [40, 3, 16, 0, 17]


def _twin(seq_lens, hk, d, device, seed=3, extra=0):
    """A twin cache on shuffled pages: each row's window (and ``extra``
    positions before it) holds random bf16 K/V, every other slot NaN."""
    g = torch.Generator().manual_seed(seed)
    pages = [max(math.ceil(n / TWIN_PAGE), 1) for n in seq_lens]
    blocks = sum(pages) + 1
    k = torch.full((blocks, TWIN_PAGE, hk, d), float("nan"))
    v = torch.full((blocks, TWIN_PAGE, hk, d), float("nan"))
    order = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for row, n in enumerate(seq_lens):
        table[row, : pages[row]] = order[used : used + pages[row]]
        used += pages[row]
        for pos in range(max(n - W - extra, 0), n):
            b, t = table[row, pos // TWIN_PAGE], pos % TWIN_PAGE
            k[b, t] = torch.randn(hk, d, generator=g) * 0.8
            v[b, t] = torch.randn(hk, d, generator=g)
    k, v = k.bfloat16().to(device), v.bfloat16().to(device)
    return k, v, table.to(device)


def _reference(q_in, cache, table, seq_lens, cfg, centroids, twin, scale, rot=None):
    """float64 attention: packed slots before the window, twin slots in it;
    ``rot``: values stored rotated by it, the output rotated back."""
    k_twin, v_twin, twin_table = (x.cpu() for x in twin)
    B, Hq, D = q_in.shape
    hk = cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for row, n in enumerate(seq_lens):
        if n == 0:
            continue
        cut = max(n - W, 0)
        pos = torch.arange(cut)
        k, v = dequantize(
            cache.cpu()[table.cpu()[row, pos // PAGE].long(), pos % PAGE],
            cfg, centroids, D,
        )  # fmt: skip
        pos = torch.arange(cut, n)
        blocks = twin_table[row, pos // TWIN_PAGE].long()
        k = torch.cat([k, k_twin[blocks, pos % TWIN_PAGE].double()])
        v = torch.cat([v, v_twin[blocks, pos % TWIN_PAGE].double()])
        for h in range(Hq):
            kv = h // (Hq // hk)
            p = torch.softmax((k[:, kv] @ q_in[row, h]) * scale, dim=0)
            out[row, h] = p @ v[:, kv]
    return out if rot is None else out @ rot.cpu().double()


def _case(preset, device, d=64, hk=2, gqa=2, seq_lens=SEQ_LENS):
    cfg, centroids, pit, cache, table = packed_case(preset, d, seq_lens, hk, device)
    g = torch.Generator().manual_seed(9)
    query = (torch.randn(len(seq_lens), hk * gqa, d, generator=g) * 1.5).to(device)
    twin = _twin(seq_lens, hk, d, device)
    window = RawWindow(twin[0], twin[1], twin[2], W)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return cfg, centroids, pit, cache, table, query, twin, window, seq_t


def _check(out, ref):
    assert not out.isnan().any(), "a slot outside the window was read"
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("scratch", [False, True])
def test_triton_decode_reads_the_window_raw(preset, num_splits, scratch, triton_device):
    """At one split too (stage 1 then weighs the window in), with the
    decode's own scratch or the caller's."""
    cfg, centroids, pit, cache, table, query, twin, window, seq_t = _case(
        preset, triton_device
    )
    B, Hq, d = query.shape
    mid = poisoned((B, Hq, 8, d + 1), triton_device) if scratch else None
    out = decode(
        query, cache, table, seq_t, cfg, centroids, pit, stage="triton",
        num_splits=num_splits, raw_window=window, mid_o_buf=mid,
    )  # fmt: skip
    q_in = query.cpu().double()
    if not cfg.key_fp8:
        q_in = q_in @ pit.cpu().double()
    ref = _reference(q_in, cache, table, SEQ_LENS, cfg, centroids, twin, d**-0.5)
    _check(out, ref)
    assert not out[SEQ_LENS.index(0)].any()


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_window_is_one_more_split(preset, num_splits, triton_device):
    """The window's partial result is split ``num_splits`` of the caller's
    scratch: the merge weighs it in, and at one split stage 1 does, writing
    no partial of its own (a merge of forced splits made 512 x 640
    1.17-1.23x slower). Rotated values are rotated back after it."""
    cfg, centroids, pit, cache, table, query, twin, window, seq_t = _case(
        preset, triton_device
    )
    B, Hq, d = query.shape
    rotated = not cfg.key_fp8
    rot = _build_hadamard(d, triton_device) if rotated else pit
    mid = poisoned((B, Hq, 4, d + 1), triton_device)
    out = decode(
        query, cache, table, seq_t, cfg, centroids, rot, stage="triton",
        num_splits=num_splits, raw_window=window, mid_o_buf=mid,
        hadamard_query=rotated, value_rotation=rotated,
    )  # fmt: skip
    q_in = query.cpu().double()
    if rotated:
        q_in = q_in @ rot.cpu().double()
    ref = _reference(
        q_in, cache, table, SEQ_LENS, cfg, centroids, twin, d**-0.5,
        rot=rot if rotated else None,
    )  # fmt: skip
    _check(out, ref)
    assert not mid[:, :, num_splits].isnan().any(), "the window's slot is empty"
    if num_splits == 1:
        assert mid[:, :, 0].isnan().all(), "stage 1 wrote a partial result"


@pytest.mark.parametrize("hadamard", [False, True])
def test_verify_rows_read_their_requests_window(hadamard, triton_device):
    """Speculative verify rows: rows 0-2 are one request's last three
    positions (lengths 38, 39, 40), row 3 another request's; each row reads
    its request's row of the twin's block table."""
    lens = [38, 39, 40, 21]
    cfg, centroids, pit, cache, table, query, _, _, seq_t = _case(
        "turboquant_3bit_nc", triton_device, seq_lens=lens
    )
    B, Hq, d = query.shape
    k, v, requests = _twin([40, 21], 2, d, triton_device, extra=2)
    rows = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=triton_device)
    window = RawWindow(k, v, requests, W, row_requests=rows)
    rot = _build_hadamard(d, triton_device) if hadamard else pit
    out = decode(
        query, cache, table, seq_t, cfg, centroids, rot, stage="triton",
        num_splits=2, raw_window=window, hadamard_query=hadamard,
    )  # fmt: skip
    q_in = query.cpu().double() @ rot.cpu().double()
    twin = (k, v, requests[rows.long()])
    _check(out, _reference(q_in, cache, table, lens, cfg, centroids, twin, d**-0.5))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_gluon_decode_reads_the_window_raw(
    num_splits,
    triton_interpret,
    gluon_on_numpy,  # noqa: F811 (the fixture imported above)
):
    """Rotated values; at one split stage 1 weighs the window in and
    writes no partial of its own."""
    cfg, centroids, _, cache, table, query, twin, window, seq_t = _case(
        "turboquant_4bit_nc", triton_interpret, d=128
    )
    B, Hq, d = query.shape
    had = _build_hadamard(d, "cpu")
    mid = poisoned((B, Hq, 4, d + 1), "cpu")
    out = decode(
        query.half(), cache, table, seq_t, cfg, centroids, had, stage="gluon",
        num_splits=num_splits, raw_window=window, hadamard_query=True,
        value_rotation=True, mid_o_buf=mid,
    )  # fmt: skip
    assert gluon_on_numpy, "decode_attention did not take the Gluon stage 1"
    q_in = query.half().double() @ had.double()
    ref = _reference(
        q_in, cache, table, SEQ_LENS, cfg, centroids, twin, d**-0.5, rot=had
    )
    assert not out.isnan().any()
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2**-9, err  # the output is rounded to fp16
    assert not mid[:, :, num_splits].isnan().any(), "the window's slot is empty"
    if num_splits == 1:
        assert mid[:, :, 0].isnan().all(), "stage 1 wrote a partial result"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gluon_decode_reads_the_window_raw_on_the_gpu(
    preset, num_splits, triton_device
):
    if triton_device != "cuda" or tq_decode.gluon_stage1(torch.device("cuda")) is None:
        pytest.skip("the Gluon stage 1 runs on sm_89+ GPUs")
    cfg, centroids, _, cache, table, query, twin, window, seq_t = _case(
        preset, "cuda", d=128
    )
    d = query.shape[-1]
    had = _build_hadamard(d, "cuda")
    out = decode(
        query, cache, table, seq_t, cfg, centroids, had, stage="gluon",
        num_splits=num_splits, raw_window=window, hadamard_query=True,
        value_rotation=True,
    )  # fmt: skip
    q_in = query.cpu().double() @ had.cpu().double()
    ref = _reference(
        q_in, cache, table, SEQ_LENS, cfg, centroids, twin, d**-0.5, rot=had
    )
    _check(out, ref)


def test_the_legacy_decode_is_refused(triton_device, monkeypatch):
    cfg, centroids, pit, cache, table, query, _, window, seq_t = _case(
        "turboquant_4bit_nc", triton_device
    )
    monkeypatch.setattr(tq_decode.envs, "VLLM_TURBOQUANT_DECODE", "legacy")
    # The fix it names is a flag that exists: the skip list's recent:W entry.
    with pytest.raises(
        ValueError,
        match="raw window.*VLLM_TURBOQUANT_DECODE=legacy.*drop the recent:W entry "
        "from --kv-cache-dtype-skip-layers",
    ):
        tq_decode.maybe_decode_attention(
            query, cache, table, seq_t, pit.T.contiguous(), centroids,
            query.shape[-1] ** -0.5, cfg.key_mse_bits, cfg.key_packed_size,
            cfg.effective_value_quant_bits, norm_correction=cfg.norm_correction,
            raw_window=window,
        )  # fmt: skip


@pytest.mark.parametrize("offset", [False, True])
def test_the_window_rides_on_the_query_rotation(offset, triton_device):
    """``rotate_and_attend`` returns what ``rotate_query`` (with an offset:
    ``rotate_query_with_offset``) returns, and the packed splits' lengths."""
    from vllm.v1.attention.ops.triton_turboquant_rotate_query import (
        rotate_query,
        rotate_query_with_offset,
    )

    *_, query, _, window, seq_t = _case("turboquant_3bit_nc", triton_device)
    B, Hq, d = query.shape
    had = _build_hadamard(d, triton_device)
    g = torch.Generator().manual_seed(5)
    key_scale = (torch.rand(d, generator=g) + 0.5).to(triton_device)
    key_offset = torch.randn(2, d, generator=g).to(triton_device) if offset else None
    mid = poisoned((B, Hq, 3, d + 1), triton_device)
    q_in, qmu, packed = window.rotate_and_attend(
        query, had, key_scale, key_offset, seq_t, mid, 2, d**-0.5
    )
    if offset:
        ref_q, ref_mu = rotate_query_with_offset(query, had, key_scale, key_offset)
        torch.testing.assert_close(qmu, ref_mu)
    else:
        ref_q, ref_mu = rotate_query(query, had, key_scale), None
        assert qmu is None
    torch.testing.assert_close(q_in, ref_q)
    assert packed.tolist() == [max(n - W, 0) for n in SEQ_LENS]
    assert mid[:, :, :2].isnan().all(), "only the window's slot is written"
    assert not mid[:, :, 2].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("hadamard", [False, True])
def test_wide_heads_read_the_window_raw_on_the_gpu(d, hadamard, triton_device):
    """Gemma's head_dim 256 and 512 (twins on TRITON_ATTN at 512), through
    the rotation's launch and the window's own."""
    if triton_device != "cuda":
        pytest.skip("a GPU test")
    cfg, centroids, pit, cache, table, query, twin, window, seq_t = _case(
        "turboquant_3bit_nc", "cuda", d=d
    )
    rot = _build_hadamard(d, "cuda") if hadamard else pit
    out = decode(
        query, cache, table, seq_t, cfg, centroids, rot, num_splits=3,
        raw_window=window, hadamard_query=hadamard, value_rotation=hadamard,
    )  # fmt: skip
    q_in = query.cpu().double() @ rot.cpu().double()
    ref = _reference(
        q_in, cache, table, SEQ_LENS, cfg, centroids, twin, d**-0.5,
        rot=rot if hadamard else None,
    )  # fmt: skip
    _check(out, ref)
