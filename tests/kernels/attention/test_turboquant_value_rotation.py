# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant layers with MSE keys store their values Hadamard-rotated and
rotate attention's output back.

``turboquant.value_rotation``: the store codes ``H v`` (``H`` the backend's
scaled Hadamard matrix) with 0.20.2's min/max value code; the decodes
rotate the output back (the merge where they split, one pass of its own at
one split); continuations rotate the
dequantized values back. Checked against float64 references of the codes,
of attention over the stored slots, and of attention over the original
values through the backend's mixed step. Values here have a few outlier
channels, as trained models' do, which is where the rotation pays. Runs
under the Triton CPU interpreter (``HYBRIDKV_TRITON_INTERPRET=1``; the Gluon
stage 1 on NumPy) and natively on a GPU.
"""

import math

import pytest
import torch

from tests.kernels.attention.test_turboquant_decode_gluon import (
    gluon_on_numpy,  # noqa: F401 (fixture)
)
from tests.kernels.attention.test_turboquant_prefill_batch import (
    HK,
    D,
    _error,
    _run,
    flash,  # noqa: F401 (fixture)
)
from tests.kernels.attention.turboquant_packed import (
    PAGE,
    TOL,
    decode,
    dequantize,
    fp16_values,
    poisoned,
    unpack_bits,
)
from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.model_executor.layers.quantization.turboquant.value_rotation import (
    rotates_values,
)
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.backends.turboquant_prefill_batch import (
    _dequantize_cached,
    aligned_block_row,
)
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops.triton_turboquant_decode_splitkv import (
    rotate_output_back,
)
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store
from vllm.v1.attention.ops.turboquant_slot_layout import slot_layout

ROTATED_PRESETS = ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def _kv(n: int, hk: int, d: int, seed: int):
    """Keys; values with four outlier channels per head."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, hk, d, generator=g)
    v = torch.randn(n, hk, d, generator=g)
    v[..., :: d // 4] *= 12.0
    return k, v


def _store(cfg, k, v, cache, slots, value_rotation):
    d = k.shape[-1]
    c, _ = get_centroids(d, cfg.centroid_bits).float().sort()
    turboquant_store(
        k, v, cache, slots, _build_hadamard(d, str(k.device)),
        ((c[:-1] + c[1:]) / 2).to(k.device), **store_kwargs(cfg),
        value_rotation=value_rotation,
    )  # fmt: skip


def _stored(preset, device, n=8 * PAGE, hk=2, d=128, seed=1):
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    k, v = (t.to(device) for t in _kv(n, hk, d, seed))
    cache = torch.zeros(
        math.ceil(n / PAGE), PAGE, hk, cfg.slot_size_aligned, dtype=torch.uint8
    ).to(device)
    _store(cfg, k, v, cache, torch.arange(n, device=device), value_rotation=True)
    return cfg, cache, k, v


# ----------------------------------------------------------------- the store


@pytest.mark.parametrize("preset", ROTATED_PRESETS)
def test_store_codes_the_rotated_values(preset, triton_device):
    """The value field holds 0.20.2's code of ``H v``: minimum and step in
    fp16, each coordinate's level the nearest on that grid (a coordinate
    within 1e-3 of a level's boundary may take either side: the kernel
    rotates in fp32). The key field is the unrotated store's."""
    cfg, cache, k, v = _stored(preset, triton_device, n=2 * PAGE)
    n, hk, d = v.shape
    plain = torch.zeros_like(cache)
    _store(cfg, k, v, plain, torch.arange(n, device=triton_device), False)
    kb = cfg.key_packed_size
    assert torch.equal(cache[..., :kb], plain[..., :kb])

    bits = cfg.effective_value_quant_bits
    top = (1 << bits) - 1
    field = cache.cpu().view(n, hk, -1)[..., kb:]
    nbytes = slot_layout(d, False, cfg.key_mse_bits, bits).value_index_bytes
    codes = unpack_bits(field[..., :nbytes], bits, d)
    step16 = fp16_values(field[..., nbytes : nbytes + 2])
    min16 = fp16_values(field[..., nbytes + 2 : nbytes + 4])

    rot = v.cpu().double() @ _build_hadamard(d, "cpu").double()
    lo, hi = rot.amin(-1), rot.amax(-1)
    step = (hi - lo) / top
    torch.testing.assert_close(min16, lo.half().double(), rtol=0, atol=0)
    torch.testing.assert_close(step16, step.half().double(), rtol=1e-3, atol=0)
    grid = (rot - lo[..., None]) / step[..., None]
    want = (grid + 0.5).floor().clamp(0, top)
    boundary = (grid - grid.floor() - 0.5).abs() < 1e-3
    assert ((codes == want) | boundary).all()
    assert boundary.float().mean() < 0.01


def test_store_refuses_rotation_without_the_fused_store(triton_device):
    d = 128
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", d)
    k, v = (t.to(triton_device) for t in _kv(4, 1, d, seed=2))
    cache = torch.zeros(1, PAGE, 1, cfg.slot_size_aligned, dtype=torch.uint8)
    with pytest.raises(ValueError, match="value_rotation needs the fused MSE store"):
        _store(
            cfg, k, v, cache.to(triton_device), torch.arange(4, device=triton_device),
            value_rotation=True,
        )  # fmt: skip


# ---------------------------------------------------------------- the decodes


SEQ_LENS = [45, 17, 1, 0]
TABLE = [[5, 0, 3], [2, 6, 7], [1, 4, 4], [0, 0, 0]]


def _reference(query, cache, cfg, scale):
    """float64 attention over the stored slots, rotated back by ``H``."""
    B, Hq, d = query.shape
    hk = cache.shape[2]
    pit = _build_hadamard(d, "cpu").double()
    centroids = get_centroids(d, cfg.centroid_bits)
    q_rot = query.cpu().double() @ pit
    table = torch.tensor(TABLE)
    out = torch.zeros(B, Hq, d, dtype=torch.float64)
    for row, n in enumerate(SEQ_LENS):
        if n == 0:
            continue
        pos = torch.arange(n)
        k, v = dequantize(cache.cpu()[table[row, pos // PAGE], pos % PAGE], cfg,
                          centroids, d)  # fmt: skip
        for h in range(Hq):
            kv = h // (Hq // hk)
            p = torch.softmax((k[:, kv] @ q_rot[row, h]) * scale, dim=0)
            out[row, h] = (p @ v[:, kv]) @ pit
    return out


def _decode_case(preset, device):
    cfg, cache, _, _ = _stored(preset, device)
    g = torch.Generator().manual_seed(4)
    query = (1.5 * torch.randn(len(SEQ_LENS), 4, 128, generator=g)).to(device)
    table = torch.tensor(TABLE, dtype=torch.int32, device=device)
    seq_t = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    return cfg, cache, table, seq_t, query


@pytest.mark.parametrize(
    "preset, num_splits",
    [
        ("turboquant_4bit_nc", 1),
        ("turboquant_k3v4_nc", 2),
        ("turboquant_3bit_nc", 1),
        ("turboquant_3bit_nc", 3),
    ],
)
def test_triton_decode_rotates_the_output_back(preset, num_splits, triton_device):
    """At one split too: stage 1 then writes the output, which one pass
    rotates back in place."""
    cfg, cache, table, seq_t, query = _decode_case(preset, triton_device)
    d = query.shape[-1]
    out = decode(
        query, cache, table, seq_t, cfg,
        get_centroids(d, cfg.centroid_bits).to(triton_device),
        _build_hadamard(d, triton_device), hadamard_query=True, stage="triton",
        num_splits=num_splits, value_rotation=True,
    )  # fmt: skip
    ref = _reference(query, cache, cfg, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err
    assert not out[SEQ_LENS.index(0)].any()


@pytest.mark.parametrize("stage", ["triton", "gluon"])
def test_one_split_writes_no_partial_results(
    stage,
    triton_interpret,
    gluon_on_numpy,  # noqa: F811 (the fixture imported above)
):
    """A decode that does not split skips the merge: stage 1 writes the
    output in the model dtype (fp16 here: Gluon on NumPy has no bf16), and
    one pass rotates it back in place. The split scratch stays untouched:
    fp32 partial results and a merge there would cost a large batch what
    not splitting saves."""
    cfg, cache, table, seq_t, query = _decode_case(
        "turboquant_4bit_nc", triton_interpret
    )
    B, Hq, d = query.shape
    scratch = poisoned((B, Hq, 4, d + 1), triton_interpret)
    out = decode(
        query.half(), cache, table, seq_t, cfg,
        get_centroids(d, cfg.centroid_bits), _build_hadamard(d, "cpu"),
        hadamard_query=True, stage=stage, num_splits=1, value_rotation=True,
        mid_o_buf=scratch,
    )  # fmt: skip
    assert stage == "triton" or gluon_on_numpy, "the Gluon stage 1 did not run"
    assert scratch.isnan().all(), "stage 1 wrote partial results at one split"
    assert out.dtype == torch.float16
    ref = _reference(query.half().float(), cache, cfg, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    # Two roundings to fp16 (stage 1's output, then the rotated one).
    assert err < 2**-9, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 256])
def test_rotate_output_back_in_place(d, dtype, triton_device):
    """Every (row, head) of a strided output times ``H``, in place; 6 query
    heads of 8 held per row: the last program of each row is half empty,
    and the heads past the view stay as they were."""
    g = torch.Generator().manual_seed(7)
    held = torch.randn(3, 8, d, generator=g).to(dtype)
    buf = held.to(triton_device)
    x = buf[:, :6]  # rows 8 x d apart
    pit = _build_hadamard(d, triton_device)
    ref = held[:, :6].double() @ _build_hadamard(d, "cpu").double()
    assert rotate_output_back(x, pit) is x
    err = (x.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < (2**-7 if dtype == torch.bfloat16 else 1e-6), err
    assert torch.equal(buf[:, 6:].cpu(), held[:, 6:])


@pytest.mark.parametrize("preset, num_splits", [("turboquant_k3v4_nc", 1),
                                                ("turboquant_4bit_nc", 2)])  # fmt: skip
def test_gluon_decode_rotates_the_output_back(
    preset,
    num_splits,
    triton_interpret,
    gluon_on_numpy,  # noqa: F811 (the fixture imported above)
):
    cfg, cache, table, seq_t, query = _decode_case(preset, triton_interpret)
    d = query.shape[-1]
    out = decode(
        query, cache, table, seq_t, cfg, get_centroids(d, cfg.centroid_bits),
        _build_hadamard(d, "cpu"), hadamard_query=True, stage="gluon",
        num_splits=num_splits, value_rotation=True,
    )  # fmt: skip
    assert gluon_on_numpy, "decode_attention did not take the Gluon stage 1"
    ref = _reference(query, cache, cfg, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ROTATED_PRESETS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gluon_decode_rotates_the_output_back_on_the_gpu(
    preset, num_splits, triton_device
):
    if triton_device != "cuda" or tq_decode.gluon_stage1(torch.device("cuda")) is None:
        pytest.skip("the Gluon stage 1 runs on sm_89+ GPUs")
    cfg, cache, table, seq_t, query = _decode_case(preset, "cuda")
    d = query.shape[-1]
    out = decode(
        query, cache, table, seq_t, cfg,
        get_centroids(d, cfg.centroid_bits).cuda(), _build_hadamard(d, "cuda"),
        hadamard_query=True, stage="gluon", num_splits=num_splits,
        value_rotation=True,
    )  # fmt: skip
    ref = _reference(query, cache, cfg, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


def test_the_legacy_decode_is_refused(triton_device, monkeypatch):
    cfg, cache, table, seq_t, query = _decode_case("turboquant_4bit_nc", triton_device)
    monkeypatch.setattr(tq_decode.envs, "VLLM_TURBOQUANT_DECODE", "legacy")
    d = query.shape[-1]
    with pytest.raises(ValueError, match="values are stored rotated.*turboquant_k8v4"):
        tq_decode.maybe_decode_attention(
            query, cache, table, seq_t, _build_hadamard(d, triton_device),
            get_centroids(d, cfg.centroid_bits).to(triton_device), d**-0.5,
            **{k: v for k, v in store_kwargs(cfg).items() if k != "key_fp8"},
            norm_correction=True, value_rotation=True,
        )  # fmt: skip


# ---------------------------------------------------------- the continuations


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "turboquant_3bit_nc"])
def test_continuations_rotate_values_back(preset, triton_device):
    """The dequantized values are the stored ones times ``H``, and near the
    originals: within the code's half step, rotated."""
    cfg, cache, _, v = _stored(preset, triton_device, n=3 * PAGE)
    n, hk, d = v.shape
    impl = type("Impl", (), {"head_size": d, "tq_config": cfg})()
    pit = _build_hadamard(d, triton_device)
    centroids = get_centroids(d, cfg.centroid_bits).to(triton_device)
    table = torch.arange(cache.shape[0], dtype=torch.int32, device=triton_device)
    row = aligned_block_row(table[None], 0)
    _, got = _dequantize_cached(
        impl, cache, row, n, pit, centroids, torch.float32, value_rotation=True
    )
    _, stored = dequantize(cache.cpu().view(n, hk, -1), cfg, centroids, d)
    # 0.20.2's dequantization writes fp16; the rotation back is fp32.
    want = stored.half().double() @ _build_hadamard(d, "cpu").double()
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    step = (stored.amax(-1) - stored.amin(-1)) / (
        (1 << cfg.effective_value_quant_bits) - 1
    )
    # |H e| <= sqrt(d) |e|_inf for the code's error e (|e|_inf <= step / 2).
    bound = 0.5 * step.max().item() * math.sqrt(d)
    assert (got.cpu().double() - v.cpu().double()).abs().max() < bound


# ------------------------------------------------------ a mixed forward step


def _outlier_kv(n, device):
    k, v = _kv(n, HK, D, seed=n)
    return k.to(device), v.to(device)


@pytest.mark.parametrize("preset", ROTATED_PRESETS)
def test_a_mixed_step_reads_rotated_values(
    preset,
    triton_device,
    flash,  # noqa: F811 (the fixture imported above)
    monkeypatch,
):
    """A decode row, two first chunks and a continuation of a layer that
    rotates its values: float64 attention over the original K/V within the
    presets' quantization error, as the same layer storing them unrotated
    is (a value read unrotated is off by the whole output). Which of the
    two is nearer depends on the draw: on an H200 3bit_nc's rotated error
    was 0.049 against 0.043 unrotated, under the interpreter 0.054 against
    0.057."""
    rotated = _run(preset, triton_device, monkeypatch, make_kv=_outlier_kv)
    assert rotates_values(rotated.impl)
    monkeypatch.setattr(turboquant_attn, "rotates_values", lambda impl: False)
    plain = _run(preset, triton_device, monkeypatch, make_kv=_outlier_kv)
    assert _error(rotated) < min(0.1, 1.25 * _error(plain)), (
        _error(rotated),
        _error(plain),
    )


# ------------------------------------------------------------- which layers


@pytest.mark.parametrize(
    "preset, head_dim, decode_stage, rotated",
    [
        ("turboquant_4bit_nc", 128, "gluon", True),
        ("turboquant_k3v4_nc", 256, "gluon", True),
        ("turboquant_3bit_nc", 64, "triton", True),
        ("turboquant_3bit_nc", 512, "gluon", True),
        ("turboquant_k8v4", 128, "gluon", False),
        ("turboquant_4bit_nc", 96, "gluon", False),
        ("turboquant_3bit_nc", 128, "legacy", False),
    ],
)
def test_layers_that_rotate_values(
    preset, head_dim, decode_stage, rotated, monkeypatch
):
    monkeypatch.setattr(tq_decode.envs, "VLLM_TURBOQUANT_DECODE", decode_stage)
    impl = type("Impl", (), {})()
    impl.tq_config = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    impl.head_size, impl.num_heads, impl.num_kv_heads = head_dim, 8, 2
    assert rotates_values(impl) is rotated
    monkeypatch.setattr(tq_decode.envs, "VLLM_TURBOQUANT_DECODE", "legacy")
    assert rotates_values(impl) is rotated  # decided once per layer
