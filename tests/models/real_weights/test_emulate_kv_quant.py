# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-quantization emulator's needle mode reads the prompt raw.

``--needle`` scores the retrieval step alone: the prompt attends raw and only
the rows that predict the answer read the cache quantized. The prompt once
ran with the previous configuration's quantized layers still set, so every
case but the first of a run measured a chunk-quantized prefill and a
configuration's result depended on the one before it.

``calib0``/``calibks0``/``calibraw``/``calibmin`` treat the sequence's first
key apart from calib's shift; ``+v`` adds a value offset."""

from types import SimpleNamespace

import pytest
import torch

from tests.models.real_weights import emulate_kv_quant as emu

pytestmark = pytest.mark.cpu_test


def test_the_needle_prompt_runs_with_no_quantized_layer(monkeypatch):
    seen = []

    def forward(input_ids, past_key_values):
        seen.append((set(emu.EMU.layers), emu.EMU.answer_from))

    lm = SimpleNamespace(model=forward)
    tokenizer = lambda text, add_special_tokens: SimpleNamespace(  # noqa: E731
        input_ids=[ord(c) for c in text]
    )
    monkeypatch.setattr(emu.EMU, "layers", {3, 4})  # the last configuration's
    monkeypatch.setattr(emu.EMU, "answer_from", 7)
    case = SimpleNamespace(prompt=[1, 2, 3], number="42")
    _, answer = emu.needle_prompt(lm, tokenizer, case)
    assert seen == [(set(), None)]
    assert answer == [ord(" "), ord("4"), ord("2")]


@pytest.mark.parametrize("fix", ["calib0", "calibks0"])
def test_calib_variants_treat_the_first_key_apart(fix):
    """calib0 (calibks0: with a key scale) = no fix (kscale) for the
    sequence's first key, calib's shift (with the scale) for every other;
    calibraw = calib with the first key raw."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 5, 64, generator=g)
    mu = torch.randn(2, 1, 64, generator=g).double()
    s = torch.rand(64, generator=g).double() + 0.5
    e = emu.Emu()
    e.fix = fix
    e.kbits, e.nc, e.calib, e.key_scale = 3, True, {7: mu}, {7: s}
    if fix == "calib0":
        s = torch.ones(64, dtype=torch.float64)
    got = e.quant_k(k, 7)
    kd = k.double()
    shifted = emu.quant_keys_mse((kd - mu) / s, 3, True) * s + mu
    assert torch.equal(got[:, 0], (emu.quant_keys_mse(kd / s, 3, True) * s)[:, 0])
    assert torch.equal(got[:, 1:], shifted[:, 1:])
    assert not torch.allclose(got[:, 0], shifted[:, 0])
    e.fix = "calibraw"
    raw = e.quant_k(k, 7)
    assert torch.equal(raw[:, 0], kd[:, 0])
    assert torch.equal(raw[:, 1:], emu.quant_keys_mse(kd - mu, 3, True)[:, 1:] + mu)


def _shorter_way(fix: str, k: torch.Tensor, mu: torch.Tensor):
    """``fix``'s keys, and every key 3-bit quantized shifted and unshifted."""
    e = emu.Emu()
    e.fix, e.kbits, e.nc, e.calib = fix, 3, True, {7: mu}
    kd = k.double()
    shifted = emu.quant_keys_mse(kd - mu, 3, True) + mu
    return e.quant_k(k, 7), shifted, emu.quant_keys_mse(kd, 3, True)


def test_calibmin_stores_the_first_key_the_shorter_way():
    """Per KV head, key 0 shifted where it lies nearer the mean than the
    origin, unshifted where nearer the origin; later keys always shifted."""
    g = torch.Generator().manual_seed(1)
    mu = 4 * torch.randn(2, 1, 64, generator=g).double()
    k = torch.randn(2, 5, 64, generator=g)
    k[0, 0] = (mu[0, 0] + 0.1 * torch.randn(64, generator=g)).float()  # near mu
    k[1, 0] = 0.1 * torch.randn(64, generator=g)  # near the origin
    got, shifted, plain = _shorter_way("calibmin", k, mu)
    assert torch.equal(got[0, 0], shifted[0, 0])
    assert torch.equal(got[1, 0], plain[1, 0])
    assert torch.equal(got[:, 1:], shifted[:, 1:])


def test_calibany_stores_every_key_the_shorter_way():
    """calibmin's rule for every key, not key 0 alone (release 35's store)."""
    g = torch.Generator().manual_seed(2)
    mu = 4 * torch.randn(1, 1, 64, generator=g).double()
    k = (mu + 0.1 * torch.randn(1, 6, 64, generator=g)).float()
    k[0, 3] = 0.1 * torch.randn(64, generator=g)  # a later key near the origin
    got, shifted, plain = _shorter_way("calibany", k, mu)
    assert torch.equal(got[0, 3], plain[0, 3])
    rest = [0, 1, 2, 4, 5]
    assert torch.equal(got[0, rest], shifted[0, rest])
    # Key 3 is not a sequence's first: calibmin shifts it.
    assert torch.equal(_shorter_way("calibmin", k, mu)[0][0, 3], shifted[0, 3])


def test_a_value_offset_quantizes_what_the_values_do_not_share():
    """``+v``: values stored minus their calibrated mean and read back with it
    (the attention output gains it exactly); the key fix before it applies
    unchanged."""
    g = torch.Generator().manual_seed(3)
    mu_v = 6 * torch.randn(2, 1, 64, generator=g).double()
    v = (mu_v + torch.randn(2, 9, 64, generator=g)).float()
    k = torch.randn(2, 9, 64, generator=g)
    mu = torch.randn(2, 1, 64, generator=g).double()
    e = emu.Emu()
    e.kbits, e.vbits, e.nc, e.calib, e.vcalib = 3, 3, True, {7: mu}, {7: mu_v}
    e.fix = "calibmin"
    keys, plain = e.quant_k(k, 7), e.quant_v(v, 7)
    e.fix = "calibmin+v"
    assert torch.equal(e.quant_k(k, 7), keys)
    got = e.quant_v(v, 7)
    assert torch.equal(got, emu.quant_values(v.double() - mu_v, 3) + mu_v)
    vd = v.double()
    assert (got - vd).norm() < 0.5 * (plain - vd).norm()


def test_rotated_values_are_quantized_in_the_hadamard_basis():
    """``+vr``: values quantized after a normalized Hadamard rotation and
    rotated back; an outlier channel no longer sets every level's step. The
    key fix before it applies unchanged."""
    h = emu.hadamard(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        emu.hadamard(48)
    g = torch.Generator().manual_seed(5)
    v = torch.randn(2, 9, 64, generator=g)
    v[..., 3] *= 40  # one outlier channel, as trained values have
    k = torch.randn(2, 9, 64, generator=g)
    mu = torch.randn(2, 1, 64, generator=g).double()
    e = emu.Emu()
    e.kbits, e.vbits, e.nc, e.calib = 3, 3, True, {7: mu}
    e.fix = "calibmin"
    keys, plain = e.quant_k(k, 7), e.quant_v(v, 7)
    e.fix = "calibmin+vr"
    assert torch.equal(e.quant_k(k, 7), keys)
    got = e.quant_v(v, 7)
    torch.testing.assert_close(got, emu.quant_values(v.double() @ h, 3) @ h.T)
    vd = v.double()
    assert (got - vd).norm() < 0.5 * (plain - vd).norm()


@pytest.mark.parametrize("decoded, recent", [(False, 0), (True, 0), (True, 2)])
def test_the_answer_rows_read_their_own_tokens_as_configured(
    monkeypatch, decoded, recent
):
    """Needle mode: the answer's rows read the prompt quantized and their own
    tokens raw, or (``--needle-decoded``) quantized as decode steps store them,
    but for the ``--recent-raw`` tokens nearest each row."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 64, generator=g)  # [B, Hq, answer rows, D]
    k = torch.randn(1, 1, 8, 64, generator=g)  # [B, Hk, prompt + answer, D]
    v = torch.randn(1, 1, 8, 64, generator=g)
    settings = dict(kbits=3, vbits=3, nc=True, fix="", answer_from=5)
    settings.update(answer_decoded=decoded, recent_raw=recent)
    for name, value in settings.items():
        monkeypatch.setattr(emu.EMU, name, value)
    out, _ = emu._answer_rows_attention(
        SimpleNamespace(layer_idx=0), q, k, v, scaling=0.125
    )
    kq, vq = emu.EMU.quant_k(k[0], 0).float(), emu.EMU.quant_v(v[0], 0).float()
    for row in range(5, 8):  # each row's own keys and values, one at a time
        kr, vr = kq.clone(), vq.clone()
        first_raw = 5 if not decoded else row - recent + 1
        kr[:, first_raw : row + 1] = k[0, :, first_raw : row + 1]
        vr[:, first_raw : row + 1] = v[0, :, first_raw : row + 1]
        scores = q[0, :, row - 5] @ kr[0, : row + 1].T * 0.125
        want = torch.softmax(scores, dim=-1) @ vr[0, : row + 1]
        torch.testing.assert_close(out[0, row - 5], want)


def test_calibrot_follows_the_offset_around_with_the_keys_positions():
    """Keys whose common part is a pre-RoPE mean: ``calibrot`` subtracts it
    rotated to each key's position (``calibrotb``: per bucket), so far keys
    quantize better than with one post-RoPE mean of the first positions."""
    g = torch.Generator().manual_seed(5)
    inv_freq = 1.0 / 100.0 ** (torch.arange(32).double() / 32)
    c = 4 * torch.randn(1, 1, 64, generator=g).double()
    pos = torch.arange(96)
    torch.testing.assert_close(emu.rope(emu.rope(c, pos, inv_freq), -pos, inv_freq),
                               c.expand(1, 96, 64))  # fmt: skip
    k = (emu.rope(c, pos, inv_freq) + 0.3 * torch.randn(1, 96, 64, generator=g)).float()
    e = emu.Emu()
    e.kbits, e.nc, e.inv_freq, e.rot_bucket = 3, True, inv_freq, 8
    e.calib_pre = {7: c}
    e.calib = {7: k[..., :16, :].double().mean(-2, keepdim=True)}
    errors = {}
    for fix in ("calibmin", "calibrotb", "calibrot"):
        e.fix = fix
        errors[fix] = (e.quant_k(k, 7) - k.double())[..., 48:, :].norm()
    assert errors["calibrot"] < errors["calibrotb"] < errors["calibmin"], errors


def test_needle_rows_score_the_answers_nll_beside_its_hits():
    """The retrieval step's answer NLL (nats), teacher-forced: the measure
    that moves by degrees where a needle hit flips at the boundary."""
    head = torch.nn.Linear(3, 3, bias=False)
    head.weight.data = torch.eye(3)
    lm = SimpleNamespace(get_output_embeddings=lambda: head)
    hidden = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    right, nll = emu._tokens_right(lm, hidden, [0, 1])
    logp = hidden.log_softmax(-1)
    assert right == 1  # row 1 predicts token 2, not 1
    assert nll == pytest.approx(-(logp[0, 0] + logp[1, 1]).item())


def test_an_upgraded_layer_stores_its_own_preset():
    """``--upgrade``: the listed layers store the upgrade preset as vLLM
    serves it (4bit_nc: 4-bit keys without 0027's offset, rotated values),
    every other layer the configuration's, and the configuration is intact
    after an upgraded layer's call."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, 9, 64, generator=g)
    v = torch.randn(2, 9, 64, generator=g)
    mu = torch.randn(2, 1, 64, generator=g).double()
    h = emu.hadamard(64)
    e = emu.Emu()
    e.kbits, e.vbits, e.nc, e.fix = 3, 3, True, "calibmin+vr"
    e.calib = {3: mu, 5: mu}
    own_k, own_v = e.quant_k(k, 3), e.quant_v(v, 3)
    e.upgraded = {5: (4, 4, "+vr")}
    torch.testing.assert_close(e.quant_k(k, 5), emu.quant_keys_mse(k, 4, True))
    torch.testing.assert_close(
        e.quant_v(v, 5), emu.quant_values(v.double() @ h, 4) @ h.T
    )
    assert (e.kbits, e.vbits, e.fix) == (3, 3, "calibmin+vr")
    assert torch.equal(e.quant_k(k, 3), own_k)
    assert torch.equal(e.quant_v(v, 3), own_v)
    assert not torch.equal(e.quant_k(k, 5), e.quant_k(k, 3))


def test_upgrade_each_adds_one_configuration_per_layer():
    """``--upgrade-each`` follows each configuration with that configuration
    and one more of its layers upgraded, layer by layer; ``--upgrade`` is
    carried into every quantized configuration and named in it."""
    got = emu.configurations(
        ["3bit_nc"],
        ["kv"],
        [2, 3, 4],
        ["calibmin+vr"],
        upgraded=(3,),
        upgrade_each=True,
    )
    assert [(c[0], c[5], c[6]) for c in got] == [
        ("auto", "", ()),
        ("3bit_nc:kv^3", "", (3,)),
        ("3bit_nc:kv^3^2", "", (3, 2)),
        ("3bit_nc:kv^3^4", "", (3, 4)),
        ("3bit_nc:kv+calibmin+vr^3", "calibmin+vr", (3,)),
        ("3bit_nc:kv+calibmin+vr^3^2", "calibmin+vr", (3, 2)),
        ("3bit_nc:kv+calibmin+vr^3^4", "calibmin+vr", (3, 4)),
    ]
    assert all(c[1] == [2, 3, 4] for c in got[1:])
    plain = emu.configurations(["k8v4"], ["kv", "v"], [2, 3], ["mean"], per_layer=True)
    assert [c[0] for c in plain] == [
        "auto",
        "k8v4:kv",
        "k8v4:kv@L2",
        "k8v4:kv@L3",
        "k8v4:v",
        "k8v4:v@L2",
        "k8v4:v@L3",
    ]
    fixed = emu.configurations(["3bit_nc"], ["kv"], [2], ["a", "b"], fixes_only=True)
    assert [c[0] for c in fixed] == ["auto", "3bit_nc:kv+a", "3bit_nc:kv+b"]


def test_sliding_formats_store_as_vllm_caches_do():
    """``--sliding``: e4m3 is the plain cast (scale 1.0); the per-token-head
    formats scale each [D] vector by its absmax, int8 to 127 levels a side
    (error at most half a step), fp8 to e4m3's 448."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 64) * torch.logspace(-3, 1, 64)
    e4m3 = emu.quant_sliding(x, "e4m3")
    assert torch.equal(e4m3, x.to(torch.float8_e4m3fn).float())
    step = x.abs().amax(-1, keepdim=True) / 127
    int8 = emu.quant_sliding(x, "int8pth")
    assert ((int8 - x).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(int8.abs().amax(-1), x.abs().amax(-1))
    # 0.20.2's store truncates: up to a whole step, always toward zero.
    trunc = emu.quant_sliding(x, "int8pthtrunc")
    assert ((trunc - x).abs() < step + 1e-6).all()
    assert (trunc.abs() <= x.abs() + 1e-6).all()
    assert (trunc - x).abs().mean() > 1.5 * (int8 - x).abs().mean()
    fp8 = emu.quant_sliding(x, "fp8pth")
    assert torch.allclose(fp8.abs().amax(-1), x.abs().amax(-1))
    # Scaled to e4m3's range, small channels keep more precision: the plain
    # cast flushes the ones under half e4m3's smallest subnormal (2**-9).
    small = x.abs() < 2**-10
    assert small.any() and (e4m3[small] == 0).all()
    err = lambda y: (y[small] - x[small]).abs().sum()  # noqa: E731
    assert err(fp8) < err(e4m3) / 2
    with pytest.raises(ValueError, match="'int4' is not one of"):
        emu.quant_sliding(x, "int4")


def test_sliding_variants_add_each_format_alone_and_beside_each_configuration():
    configs = emu.configurations(["3bit_nc"], ["kv"], [5, 11], ["calibksmin+vr"])
    got, fmt_of = emu.sliding_variants(configs, ["e4m3", "int8pth"])
    assert [c[0] for c in got] == [
        "auto",
        "3bit_nc:kv",
        "3bit_nc:kv+calibksmin+vr",
        "sliding:e4m3",
        "3bit_nc:kv|sliding:e4m3",
        "3bit_nc:kv+calibksmin+vr|sliding:e4m3",
        "sliding:int8pth",
        "3bit_nc:kv|sliding:int8pth",
        "3bit_nc:kv+calibksmin+vr|sliding:int8pth",
    ]
    assert fmt_of["sliding:e4m3"] == "e4m3" and "auto" not in fmt_of
    assert got[3][1] == [] and got[4][1:] == configs[1][1:]
    assert emu.sliding_variants(configs, []) == (configs, {})


def test_sliding_layers_attend_to_their_stored_kv(monkeypatch):
    """A sliding-window layer's attention reads K/V as its cache format
    stores them (and, for FA3's ``e4m3q``, an e4m3 query); full layers and
    runs without ``--sliding`` are untouched."""
    seen = []

    def sdpa(module, query, key, value, mask, scaling=None, **kw):
        seen.append((query, key, value))
        return None, None

    import transformers.integrations.sdpa_attention as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", sdpa)
    monkeypatch.setattr(emu.EMU, "layers", set())
    module = SimpleNamespace(layer_idx=0)
    q, k, v = (torch.randn(1, 2, 4, 64) * 3 for _ in range(3))
    for fmt in ("", "e4m3", "e4m3q", "int8pth"):
        monkeypatch.setattr(emu.EMU, "sliding", fmt)
        emu.tq_attention(module, q, k, v, None, scaling=0.1, sliding_window=512)
    emu.tq_attention(module, q, k, v, None, scaling=0.1)  # a full layer
    raw, e4m3, e4m3q, int8, full = seen
    assert all(torch.equal(a, b) for a, b in zip(raw, (q, k, v)))
    assert torch.equal(e4m3[0], q) and torch.equal(
        e4m3[1], emu.quant_sliding(k, "e4m3")
    )
    assert torch.equal(e4m3q[0], emu.quant_sliding(q, "e4m3"))
    assert torch.equal(int8[2], emu.quant_sliding(v, "int8pth"))
    assert all(torch.equal(a, b) for a, b in zip(full, (q, k, v)))


def test_k2j1_keys_estimate_dot_products_without_bias():
    """``k2j1_nc``: 2-bit MSE keys plus a 1-bit sign sketch of their
    residual. Against any query the sketch's term is an unbiased estimate of
    the residual's dot product, so over many keys the error averages out
    where the 2-bit code alone leaves the residual's whole share."""
    torch.manual_seed(0)
    d, n = 64, 4000
    k = torch.randn(n, d, dtype=torch.float64)
    q = torch.randn(d, dtype=torch.float64)
    exact = k @ q
    prod = emu.quant_keys_mse(k, emu.QJL_KEY_BITS, True)
    two_bit = emu.quant_keys_mse(k, 2, True)
    resid = (k - two_bit) @ q
    err = prod @ q - exact
    # The sketch term estimates the residual's dot product: errors that
    # cancel across keys (|mean| well under the residual's own spread).
    assert err.mean().abs() < 0.1 * resid.abs().mean()
    corr = torch.corrcoef(torch.stack([(prod - two_bit) @ q, resid]))[0, 1]
    assert corr > 0.5, corr
    assert emu.CONFIGS["k2j1_nc"] == (emu.QJL_KEY_BITS, 3, True)


def test_k3p2_keys_spend_3bit_nc_bits_on_coordinate_pairs():
    """``k3p2_nc``: each pair of rotated coordinates one of 64 points (3 bits
    a coordinate); ``k3p2m_nc`` the same from 16 points of the positive
    quadrant and the pair's signs. Lloyd's algorithm starts from the 3-bit
    centroids' grid, so on keys whose rotated coordinates are nearly
    Gaussian their error is below the scalar code's, and each key takes at
    most 64 distinct pairs."""
    torch.manual_seed(0)
    d = 64
    k = torch.randn(2000, d, dtype=torch.float64)
    pair = emu.quant_keys_mse(k, emu.PAIR_KEY_BITS, True)
    scalar = emu.quant_keys_mse(k, 3, True)

    def err(q):
        return ((q - k) ** 2).sum(-1).mean() / (k**2).sum(-1).mean()

    mirrored = emu.quant_keys_mse(k, emu.MIRRORED_PAIR_KEY_BITS, True)
    assert err(pair) < 0.95 * err(scalar), (err(pair), err(scalar))
    assert err(mirrored) < 0.95 * err(scalar), (err(mirrored), err(scalar))
    assert len(emu._pair_codebook(d)) == 64
    assert len(emu._pair_codebook(d, mirrored=True)) == 16
    assert (emu._pair_codebook(d, mirrored=True) > 0).all()
    unit = k / k.norm(dim=-1, keepdim=True)
    rotated = emu.quant_keys_pairs(unit @ emu.hadamard(d))
    assert len(torch.unique(rotated.reshape(-1, 2), dim=0)) <= 64
    assert emu.CONFIGS["k3p2_nc"] == (emu.PAIR_KEY_BITS, 3, True)
    assert emu.CONFIGS["k3p2m_nc"] == (emu.MIRRORED_PAIR_KEY_BITS, 3, True)


@pytest.mark.parametrize(("config", "reach"), [("k3w25_nc", 2.5), ("k3w29_nc", 2.9)])
def test_wide_3bit_keys_move_only_the_outermost_level(config, reach):
    """``k3w25_nc`` / ``k3w29_nc``: 3bit_nc's scalar code with its outermost
    levels at 2.5 / 2.9 standard deviations instead of 2.15, the rest kept.
    Their mean squared error is a little above the scalar code's, which is
    Lloyd-Max's least."""
    torch.manual_seed(0)
    d = 64
    bits, values, nc = emu.CONFIGS[config]
    assert emu.WIDE_KEY_BITS[bits] == reach and (values, nc) == (3, True)
    c, mids = emu._wide_centroids(d, reach)
    base, _ = emu._centroids(d, 3)
    assert torch.allclose(c[1:-1], base[1:-1])
    assert c[-1] * d**0.5 == pytest.approx(reach) and torch.equal(c, -c.flip(0))
    assert torch.allclose(mids, (c[:-1] + c[1:]) / 2)
    k = torch.randn(4000, d, dtype=torch.float64)
    wide = emu.quant_keys_mse(k, bits, True)
    scalar = emu.quant_keys_mse(k, 3, True)

    def err(q):
        return ((q - k) ** 2).sum(-1).mean() / (k**2).sum(-1).mean()

    assert err(scalar) < err(wide) < 1.6 * err(scalar), (err(wide), err(scalar))
