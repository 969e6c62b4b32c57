# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Emulate TurboQuant's KV-cache quantization on the CPU with HF transformers.

What it does: loads a converted real checkpoint (``tests/models/real_weights``:
``gemma3_270m`` or ``smollm2_135m``) in fp32, and replaces the attention of
the layers vLLM would store as TurboQuant (default: full-attention layers
minus the first/last two attention layers; ``--layers all`` = every
full-attention layer, i.e. ``boundary:0``; or a comma list) with one that
attends to quantize->dequantize'd keys and/or values, exactly as chunked
prefill sees them: a query in chunk ``c`` (``--chunk`` tokens) reads the
cached (quantized) K/V of earlier chunks and the raw K/V of its own chunk.

Quantizers follow the store kernels' semantics: MSE keys = the float64
reference of ``tests/kernels/attention/test_turboquant_store_fused.py``
(``k / (|k| + 1e-8)``, Sylvester Hadamard / sqrt(D), bucketize against the
fp16 Lloyd-Max midpoints), dequantized as the decode kernel does (centroids,
optional norm correction, fp16 norm, inverse rotation); FP8 keys (k8v4) =
plain e4m3 cast, no scale; values = per-vector asymmetric uniform
(``(max - min) / (2^b - 1)``, round half up, fp16 scale and zero).

Also: ``--stats`` prints key/value/query statistics per full-attention layer
(max |k|, per-channel RMS spread, norms, logit range, mean-to-residual ratio,
logit noise std of 4- and 3-bit keys,
fp8 overflow count), and ``--fixes`` adds key variants (``mean``: subtract
the per-layer key mean computed over the window before quantizing, which
softmax ignores; ``sign``: random +-1 signs before the Hadamard; ``chan``:
per-channel RMS scaling before rotation; ``sink``: keep the first 4 tokens
unquantized; ``mean512``: the mean of the first 512 keys only; ``calib``: the
per-head key mean of another text, ``--calib-file``, run once raw, or of
random ids, ``--calib-ids random``; ``calib0``: calib but the sequence's first
key quantized unshifted; ``calibraw``: calib, first key raw; ``calibks0``:
calib0 with kscale; ``calibmin``/``calibksmin``: key 0 per head shifted or not,
whichever is shorter; ``calibany``/``calibksany``: every key so; any calib
fix with ``+v`` (``calibksmin+v``): values too stored minus their calibrated
per-head mean, added back to the attention output; any fix with ``+vr``
(``calibksmin+vr``): values stored rotated by a normalized Hadamard matrix,
the attention output rotated back (the weights are linear in the values);
``kscale``: the product's per-channel key scale from
``k_norm``, ``turboquant.key_scale``).
``--sliding FORMATS`` stores the sliding-window layers' K/V in vLLM's 8-bit
cache formats (``SLIDING_FORMATS``: e4m3 with or without the query cast, the
per-token-head int8, rounded or truncated as vLLM 0.20.2's store wrote it, and
e4m3), each alone and beside every quantized configuration.
``--needle LENGTHS`` scores the quality harness's needle cases instead of
perplexity, for the retrieval step alone: the prompt attends raw, and the rows
that predict the teacher-forced answer read its keys and values quantized.

Cost (2 CPU cores, fp32): Gemma-3-270M ~12-35 s per (configuration,
3,000-token window), SmolLM2-135M ~15 s for auto and ~160 s per quantized
configuration (26 emulated layers); ``--stats`` adds ~1 min (Gemma) / ~4 min
(SmolLM2); ``--check-kernels 128`` ~1 min. Default run (Gemma, 2 windows,
13 configurations): ~10 min.

Usage:
    CUDA_VISIBLE_DEVICES= .venv/bin/python \
        tests/models/real_weights/emulate_kv_quant.py \
        --model gemma3_270m --windows 2 --stats
"""

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

if "--check-kernels" in sys.argv:
    # Triton picks its interpreter when a kernel is defined, and vLLM stubs
    # Triton out unless no GPU is visible: both must be set before imports.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

LICENCES = ["GPL-3", "GPL-2", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GFDL-1.3"]
LICENCES += ["Artistic"]
PRESETS = {
    # name: (key bits: 8 = fp8, value bits, norm correction)
    "k8v4": (8, 4, False),
    "4bit_nc": (4, 4, True),
    "k3v4_nc": (3, 4, True),
    "3bit_nc": (3, 3, True),
}
# The key-bits code of TurboQuant's inner-product variant (the paper's
# TurboQuant_prod): a 2-bit MSE code plus a 1-bit sign sketch of its residual.
QJL_KEY_BITS = 21
# What --presets takes: vLLM's presets, and configurations vLLM does not
# have (issue 46: the 3-bit presets lose needles through their keys).
# k4v2_nc: 3bit_nc's bytes spent as 4-bit keys and 2-bit values; k2j1_nc:
# 3bit_nc's key bits spent as 2-bit MSE keys and a 1-bit residual sketch.
# The key-bits codes of a 2-D vector code: each pair of rotated coordinates
# one of 64 points (6 bits a pair, 3bit_nc's key bits); the mirrored one
# takes 16 points in the positive quadrant and the pair's two signs, as a
# kernel's lookup of 16 entries a pair would.
PAIR_KEY_BITS = 32
MIRRORED_PAIR_KEY_BITS = 33
# The key-bits codes of 3-bit scalar codes whose outermost level sits further
# out than Lloyd-Max's 2.15 standard deviations (2.5 and 2.9, the pair code's
# reach), the other levels kept: does the pair code gain by its reach?
WIDE_KEY_BITS = {34: 2.5, 35: 2.9}
# The key-bits code of 3bit_nc's code and decode after a store that searches
# a scale per key (``quant_unit_searched``): no byte or decode changes.
SEARCHED_KEY_BITS = 36
# ... and of k3p2_nc's pair code after the same search.
SEARCHED_PAIR_KEY_BITS = 37
# The scales that store tries; 1.0, the product's, among them.
SEARCH_SCALES = torch.linspace(0.7, 1.4, 29, dtype=torch.float64)
# k3p2_nc, k3p2m_nc: 3bit_nc's key bits spent on those pair codes; k3w25_nc,
# k3w29_nc: on those scalar codes; k3s_nc, k3p2s_nc: 3bit_nc's and k3p2_nc's
# codes after a searching store.
CONFIGS = {
    **PRESETS,
    "k4v2_nc": (4, 2, True),
    "k2j1_nc": (QJL_KEY_BITS, 3, True),
    "k3p2_nc": (PAIR_KEY_BITS, 3, True),
    "k3p2m_nc": (MIRRORED_PAIR_KEY_BITS, 3, True),
    "k3w25_nc": (34, 3, True),
    "k3w29_nc": (35, 3, True),
    "k3s_nc": (SEARCHED_KEY_BITS, 3, True),
    "k3p2s_nc": (SEARCHED_PAIR_KEY_BITS, 3, True),
}
FP8_E4M3_MAX = 448.0


# ----------------------------------------------------------------- quantizers


def _centroids(head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
        fp16_centroids,
    )

    c = fp16_centroids(head_dim, bits).double().sort().values
    return c, (c[:-1] + c[1:]) / 2


def _wide_centroids(head_dim: int, reach: float) -> tuple[torch.Tensor, torch.Tensor]:
    """3-bit centroids with the outermost pair at ``reach`` standard
    deviations of a unit key's coordinate (1 / sqrt(head_dim)), and their
    midpoints."""
    c, _ = _centroids(head_dim, 3)
    c = c.clone()
    c[0], c[-1] = -reach / math.sqrt(head_dim), reach / math.sqrt(head_dim)
    return c, (c[:-1] + c[1:]) / 2


def _sketch_matrix(d: int) -> torch.Tensor:
    """[d, d] iid N(0, 1) projections of the residual sketch (seeded)."""
    g = torch.Generator().manual_seed(4321 + d)
    return torch.randn(d, d, generator=g, dtype=torch.float64)


def quant_keys_prod(k: torch.Tensor, nc: bool) -> torch.Tensor:
    """[..., D] keys -> the keys whose dot product with any query is
    TurboQuant_prod's estimate: the 2-bit MSE key plus the residual r's
    1-bit sketch, ``|r| sqrt(pi / 2) / D * S^T sign(S r)`` (QJL: unbiased
    for every query, its variance spread over all of them). Stored: 3 bits
    per coordinate and two fp16 norms."""
    d = k.shape[-1]
    mse = quant_keys_mse(k, 2, nc)
    r = k.double() - mse
    s = _sketch_matrix(d)
    rn = r.norm(dim=-1, keepdim=True).to(torch.float16).double()
    return mse + rn * math.sqrt(math.pi / 2) / d * (torch.sign(r @ s.T) @ s)


@functools.cache
def _pair_codebook(d: int, mirrored: bool = False) -> torch.Tensor:
    """[64, 2] points for pairs of a rotated unit key's coordinates: the
    product's (``turboquant_3bit_pair_nc``'s ``pair_codebook``). ``mirrored``:
    [16, 2] points fitted by Lloyd's algorithm to the magnitudes of seeded
    pairs of independent N(0, 1/d) coordinates, from the 3-bit centroids'
    positive quadrant, to be mirrored by the pair's signs."""
    if not mirrored:
        from vllm.v1.attention.ops.turboquant_pair_code import pair_codebook

        return pair_codebook(d).double()
    g = torch.Generator().manual_seed(977 + d)
    x = torch.randn(200_000, 2, generator=g, dtype=torch.float64) / math.sqrt(d)
    c, _ = _centroids(d, 3)
    x, c = x.abs(), c[c > 0]
    points = torch.cartesian_prod(c, c)
    for _ in range(40):
        nearest = torch.cdist(x, points).argmin(1)
        sums = torch.zeros_like(points).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=len(points)).clamp_min(1)
        points = sums / counts[:, None].double()
    return points


def quant_keys_pairs(y: torch.Tensor, mirrored: bool = False) -> torch.Tensor:
    """[..., D] rotated unit keys -> each coordinate pair's nearest point of
    ``_pair_codebook`` (``mirrored``: the nearest of its magnitudes' points,
    with the pair's signs)."""
    d = y.shape[-1]
    points = _pair_codebook(d, mirrored)
    pairs = y.reshape(-1, 2)
    signs = torch.where(pairs < 0, -1.0, 1.0).to(pairs.dtype) if mirrored else 1.0
    pairs = pairs.abs() if mirrored else pairs
    nearest = torch.cat(
        [torch.cdist(chunk, points).argmin(1) for chunk in pairs.split(1 << 18)]
    )
    return (points[nearest] * signs).reshape(y.shape)


def nearest_direction(u: torch.Tensor, code) -> torch.Tensor:
    """``code(u * s)`` (``code``: rotated unit vectors -> renormalized codes)
    for the one of ``SEARCH_SCALES`` whose codes come nearest ``u``. A code
    that takes each coordinate's (or pair's) nearest point does not take the
    nearest direction; after norm correction the direction is all a key's
    error is, and the same decode reads any scale's codes."""
    best = code(u)
    best_err = (best - u).pow(2).sum(-1, keepdim=True)
    for scale in SEARCH_SCALES:
        y = code(u * scale)
        err = (y - u).pow(2).sum(-1, keepdim=True)
        best = torch.where(err < best_err, y, best)
        best_err = torch.minimum(err, best_err)
    return best


def unit_scalar(u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Rotated unit vectors ``u`` [..., D] -> each coordinate's level of ``c``
    (sorted; the store's bucket: the midpoints at or below it), renormalized."""
    y = c[torch.bucketize(u, (c[:-1] + c[1:]) / 2, right=True)]
    return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-16)


def unit_pairs(u: torch.Tensor, mirrored: bool = False) -> torch.Tensor:
    """``quant_keys_pairs``, renormalized."""
    y = quant_keys_pairs(u, mirrored)
    return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-16)


def quant_unit_searched(u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``unit_scalar`` at the nearest direction's scale."""
    return nearest_direction(u, functools.partial(unit_scalar, c=c))


# Key-bits codes that code the rotated unit vector: the code for each.
UNIT_CODES = {
    PAIR_KEY_BITS: quant_keys_pairs,
    MIRRORED_PAIR_KEY_BITS: functools.partial(quant_keys_pairs, mirrored=True),
    SEARCHED_KEY_BITS: lambda u: quant_unit_searched(u, _centroids(u.shape[-1], 3)[0]),
    SEARCHED_PAIR_KEY_BITS: functools.partial(nearest_direction, code=unit_pairs),
}


def quant_keys_mse(k: torch.Tensor, bits: int, nc: bool, signs=None) -> torch.Tensor:
    """[..., D] keys -> dequantized keys (float64), as store + decode do
    (``QJL_KEY_BITS``: ``quant_keys_prod``; the pair codes'
    ``PAIR_KEY_BITS`` and ``MIRRORED_PAIR_KEY_BITS``: ``quant_keys_pairs``;
    ``WIDE_KEY_BITS``: 3-bit scalar codes of a wider reach; the searched
    codes: ``UNIT_CODES``)."""
    from tests.kernels.attention.test_turboquant_store_fused import (
        _hadamard,
        _reference,
    )

    x = k.double() if signs is None else k.double() * signs
    if bits == QJL_KEY_BITS:
        out = quant_keys_prod(x, nc)
    else:
        d = k.shape[-1]
        if bits in UNIT_CODES:
            norm = x.norm(dim=-1)
            y = UNIT_CODES[bits]((x / (norm[..., None] + 1e-8)) @ _hadamard(d).double())
        else:
            if bits in WIDE_KEY_BITS:
                c, mids = _wide_centroids(d, WIDE_KEY_BITS[bits])
            else:
                c, mids = _centroids(d, bits)
            idx, _, norm = _reference(x, mids)
            y = c[idx]
        if nc:
            y = y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-16)
        norm16 = norm.to(torch.float16).double()[..., None]
        out = (norm16 * y) @ _hadamard(d).double()
    return out if signs is None else out * signs


def quant_keys_fp8(k: torch.Tensor) -> torch.Tensor:
    return k.float().to(torch.float8_e4m3fn).double()


# What --sliding takes: how an FP8-class cache of vLLM 0.20.2 stores the
# sliding-window layers' K/V (every position, the current chunk's too: those
# backends read their own tokens back from the cache).
SLIDING_FORMATS = {
    # plain e4m3, scale 1.0 (--kv-cache-dtype fp8), query in the model dtype
    # (Triton attention)
    "e4m3": "K/V cast to e4m3",
    # the same, and the query cast too: FlashAttention 3 reads an FP8 cache
    # with an FP8 query
    "e4m3q": "K/V and query cast to e4m3",
    # int8_per_token_head: int8 with an fp32 scale per token and head
    "int8pth": "K/V int8, absmax/127 per token and head",
    # the same as vLLM 0.20.2's Triton store writes it: the float-to-int8
    # store truncates toward zero instead of rounding
    "int8pthtrunc": "K/V int8, absmax/127 per token and head, truncated",
    # fp8_per_token_head: e4m3 with an fp32 scale per token and head
    "fp8pth": "K/V e4m3, absmax/448 per token and head",
}


def quant_sliding(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., D] keys or values (or a query, for ``e4m3q``) as a sliding
    layer's cache of format ``fmt`` stores them, in ``x``'s dtype."""
    xf = x.float()
    if fmt in ("e4m3", "e4m3q"):
        out = xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    elif fmt in ("int8pth", "int8pthtrunc"):
        scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12)
        to_int = torch.round if fmt == "int8pth" else torch.trunc
        out = to_int(xf / scale).clamp(-127, 127) * scale
    elif fmt == "fp8pth":
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-12)
        out = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    else:
        raise ValueError(
            f"sliding-layer format {fmt!r} is not one of {sorted(SLIDING_FORMATS)}"
        )
    return out.to(x.dtype)


def sliding_variants(
    configs: list[tuple], formats: list[str]
) -> tuple[list[tuple], dict[str, str]]:
    """``configs`` followed, per sliding-layer format, by that format alone
    (no TurboQuant layer) and by every quantized configuration with it; and
    each added configuration's name -> its format."""
    out, fmt_of = list(configs), {}
    for fmt in formats:
        added = [(f"sliding:{fmt}", [], 0, 0, True, "", ())]
        added += [(f"{c[0]}|sliding:{fmt}", *c[1:]) for c in configs if c[0] != "auto"]
        out += added
        fmt_of.update((c[0], fmt) for c in added)
    return out, fmt_of


def hadamard(n: int) -> torch.Tensor:
    """The backend's orthonormal n x n Sylvester Hadamard matrix, float64;
    n a power of two (the backend's builder would round it up)."""
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    return _build_hadamard(n, "cpu").double()


def quant_values(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-vector asymmetric uniform quantization, as ``_store_quantized_value``."""
    v = v.float()
    levels = 2**bits - 1
    lo = v.amin(-1, keepdim=True)
    hi = v.amax(-1, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-8)
    q = ((v - lo) / scale + 0.5).floor().clamp(0, levels)
    return q.double() * scale.half().double() + lo.half().double()


# ------------------------------------------------------------------- emulator


class Emu:
    """What the patched attention does in the quantized layers."""

    def __init__(self):
        self.layers: set[int] = set()
        self.kbits = 0  # 0 = raw keys, 8 = fp8, 3/4 = MSE
        self.vbits = 0  # 0 = raw values
        self.nc = True
        self.chunk = 512
        self.fix = ""
        self.stats: dict[int, dict] | None = None
        self.signs: dict[int, torch.Tensor] = {}
        self.capture: dict[int, tuple] | None = None
        self.key_scale: dict[int, torch.Tensor] = {}
        self.calib: dict[int, torch.Tensor] = {}  # layer -> [Hk, 1, D] key mean
        self.vcalib: dict[int, torch.Tensor] = {}  # layer -> [Hk, 1, D] value mean
        # calibrot*: the keys' mean before RoPE ([Hk, 1, D]) and the RoPE
        # frequencies of the quantized layers (NeoX halves).
        self.calib_pre: dict[int, torch.Tensor] = {}
        self.inv_freq: torch.Tensor | None = None
        self.rot_bucket = 1024
        # Needle mode: quantize only what the answer rows read (None: every
        # row reads earlier chunks quantized, as chunked prefill does).
        self.answer_from: int | None = None
        # Needle mode: the answer's rows read their own tokens quantized too,
        # as decode steps do (each stores its token before it attends).
        self.answer_decoded = False
        self.recent_raw = 0  # with answer_decoded: the nearest tokens read raw
        # layer -> (key bits, value bits, fix): layers stored with another
        # preset than the configuration's (issue 46: which layers' keys a
        # 3.5-bit budget can afford at 4 bits).
        self.upgraded: dict[int, tuple[int, int, str]] = {}
        # How the sliding-window layers' cache stores K/V (SLIDING_FORMATS;
        # "": the model dtype, as TurboQuant runs keep them by default).
        self.sliding = ""

    def configure(self, config: tuple, upgrade_preset: tuple[int, int, str]):
        """Set one entry of ``configurations`` (its name aside), its upgraded
        layers storing ``upgrade_preset``."""
        _, layers, self.kbits, self.vbits, self.nc, self.fix, up = config
        self.layers = set(layers)
        self.upgraded = dict.fromkeys(up, upgrade_preset)

    @contextlib.contextmanager
    def _layer_preset(self, layer: int):
        """The configuration's preset, or ``layer``'s in ``upgraded``."""
        own = self.upgraded.get(layer)
        if own is None:
            yield
            return
        saved = self.kbits, self.vbits, self.fix
        self.kbits, self.vbits, self.fix = own
        try:
            yield
        finally:
            self.kbits, self.vbits, self.fix = saved

    def quant_k(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        with self._layer_preset(layer):
            return self._quant_k(k, layer)

    def _quant_k(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        if self.kbits == 0:
            return k.double()
        if self.kbits == 8:
            return quant_keys_fp8(k)
        fix = self.fix.split("+")[0]
        if fix == "sign":
            g = torch.Generator().manual_seed(1234 + layer)
            s = self.signs.setdefault(
                layer,
                (torch.randint(0, 2, (k.shape[-1],), generator=g) * 2 - 1).double(),
            )
            return quant_keys_mse(k, self.kbits, self.nc, s)
        if fix in ("calibrot", "calibrotb"):
            return self._quant_k_rotating(k, layer, fix == "calibrotb")
        if fix in ("mean", "mean512") or fix.startswith("calib"):
            # softmax ignores a key offset common to all keys; "mean" takes it
            # over the window (an oracle), "mean512" over the first 512 keys
            # only (known after the first chunk), "calib*" from another text
            # or random ids (known before serving). k is the whole sequence
            # from position 0 (a window, or the needle's cached prompt), so
            # index 0 below is the sequence's first key, not a chunk's.
            kk = k.double() if fix == "mean" else k.double()[..., :512, :]
            calib = fix.startswith("calib")
            mu = self.calib[layer] if calib else kk.mean(-2, keepdim=True)
            # calibks*: with the product's key scale, as "kscale" applies it.
            s = self.key_scale[layer].double() if fix.startswith("calibks") else 1.0
            out = quant_keys_mse((k.double() - mu) / s, self.kbits, self.nc) * s + mu
            # Key 0 (SmolLM2's attention sink) is short and points away from
            # the mean, so the shift triples its norm-relative error.
            if fix == "calibraw":  # an upper bound: key 0 kept raw
                out[..., :1, :] = k[..., :1, :].double()
            elif fix in ("calib0", "calibks0", "calibmin", "calibksmin"):
                # Key 0 quantized unshifted ("0": always; "min": per KV head
                # where that vector is the shorter, the error scaling with
                # the length; Gemma's first key lies nearer the mean than the
                # origin, SmolLM2's mostly the other way). Its score is then
                # q.k0_hat, every later key's carries -q.mu: a decode that
                # subtracts q.mu from an unshifted key 0's score alone (one
                # dot product per query; a store marks the choice, e.g. in
                # the key norm's sign bit) keeps softmax's shift invariance.
                k0 = k[..., :1, :].double()
                out[..., :1, :] = (
                    quant_keys_mse(k0 / s, self.kbits, self.nc) * s
                    if fix.endswith("0")
                    else self._shorter_way(k0, mu, out[..., :1, :], s)
                )
            if fix in ("calibany", "calibksany"):
                # Every key, not only key 0, stored the shorter way (per token
                # and KV head): a store that needs no positions, only both
                # norms; a decode subtracts q.mu from every marked key.
                out = self._shorter_way(k.double(), mu, out, s)
            return out
        if fix == "chan":
            r = k.double().pow(2).mean(-2, keepdim=True).sqrt().clamp_min(1e-6)
            return quant_keys_mse(k.double() / r, self.kbits, self.nc) * r
        if fix == "kscale":
            # The product's key scale (turboquant.key_scale), from k_norm.
            s = self.key_scale[layer].double()
            return quant_keys_mse(k.double() / s, self.kbits, self.nc) * s
        out = quant_keys_mse(k, self.kbits, self.nc)
        if fix == "sink":
            out[..., :4, :] = k[..., :4, :].double()
        return out

    def _quant_k_rotating(self, k: torch.Tensor, layer: int, bucketed: bool):
        """Keys minus their pre-RoPE mean rotated to each key's position
        (``bucketed``: averaged over aligned buckets of ``rot_bucket``
        positions, one offset per bucket), added back after quantizing, as a
        decode adding ``q . mu(p)`` back per key (or per bucket) would; the
        first key the shorter way, as calibmin."""
        kd = k.double()
        mu = rope(self.calib_pre[layer], torch.arange(kd.shape[-2]), self.inv_freq)
        if bucketed:
            t, b = mu.shape[-2], self.rot_bucket
            pad = -t % b
            full = torch.cat([mu, mu[..., -1:, :].expand(*mu.shape[:-2], pad, -1)], -2)
            means = full.unflatten(-2, (-1, b)).mean(-2)
            mu = means.repeat_interleave(b, -2)[..., :t, :]
        out = quant_keys_mse(kd - mu, self.kbits, self.nc) + mu
        out[..., :1, :] = self._shorter_way(
            kd[..., :1, :], mu[..., :1, :], out[..., :1, :]
        )
        return out

    def _shorter_way(self, kd, mu, shifted, s=1.0) -> torch.Tensor:
        """Keys ``kd`` quantized unshifted where (divided by the key scale
        ``s``) that vector is shorter than ``kd - mu``, else ``shifted`` (their
        shifted quantization): the quantizer's error scales with the length."""
        plain = quant_keys_mse(kd / s, self.kbits, self.nc) * s
        keep = (kd / s).norm(dim=-1, keepdim=True) < ((kd - mu) / s).norm(
            dim=-1, keepdim=True
        )
        return torch.where(keep, plain, shifted)

    def quant_v(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        with self._layer_preset(layer):
            return self._quant_v(v, layer)

    def _quant_v(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        if self.vbits and self.fix.endswith("+vr"):
            h = hadamard(v.shape[-1])
            return quant_values(v.double() @ h, self.vbits) @ h.T
        if self.vbits and self.fix.endswith("+v"):
            # A value offset: the attention weights sum to one, so values
            # stored as v - mu_v read back exactly with mu_v added to the
            # output; the range each value's levels cover shrinks by the part
            # every value shares.
            mu = self.vcalib[layer]
            return quant_values(v.double() - mu, self.vbits) + mu
        out = v.double() if self.vbits == 0 else quant_values(v, self.vbits)
        if self.fix == "sink" and self.vbits:
            out[..., :4, :] = v[..., :4, :].double()
        return out


EMU = Emu()


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """NeoX-style RoPE (halves rotate together, as Llama and Gemma in
    transformers): [..., 1 or T, D] at ``positions`` -> [..., T, D]."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _record_stats(layer: int, q, k, v, scaling):
    """q [Hq, S, D], k/v [Hk, S, D] (one sequence)."""
    kd, vd = k.double(), v.double()
    chan_rms = kd.pow(2).mean(-2).sqrt()  # [Hk, D]
    mu = kd.mean(-2, keepdim=True)
    resid = (kd - mu).norm(dim=-1)
    knorm = kd.norm(dim=-1)
    rot = (kd / knorm[..., None]) * math.sqrt(k.shape[-1])
    from tests.kernels.attention.test_turboquant_store_fused import _hadamard

    rot = rot @ _hadamard(k.shape[-1]).double()
    rep = q.shape[0] // k.shape[0]
    logits = torch.einsum("hsd,htd->hst", q.double(), kd.repeat_interleave(rep, 0))
    logits = logits * scaling
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    lg = logits[:, causal]
    # Spread of the logits a query sees: max - median over its keys (causal).
    rows = logits[:, 256::256, :]  # sample of queries, every 256th
    spread = []
    for i in range(rows.shape[1]):
        n = 256 * (i + 1) + 1
        r = rows[:, i, :n]
        spread.append((r.amax(-1) - r.median(-1).values).max().item())
    # Logit noise the key quantizer adds: std over (query, key) pairs of
    # scaling * q . (k_hat - k), for 4- and 3-bit MSE keys (norm correction).
    qs = q.double()[:, ::8]
    noise = {}
    for bits in (4, 3):
        err = quant_keys_mse(k, bits, True) - kd
        e = torch.einsum("hsd,htd->hst", qs, err.repeat_interleave(rep, 0))
        noise[f"logit_noise_std_{bits}bit"] = (e * scaling).std().item()
    EMU.stats[layer] = {
        **noise,
        "max_abs_k": kd.abs().max().item(),
        "k_over_448": int((kd.abs() >= 464).sum()),
        "k_norm_median": knorm.median().item(),
        "k_norm_max": knorm.max().item(),
        "chan_rms_max_over_median": (chan_rms.amax(-1) / chan_rms.median(-1).values)
        .max()
        .item(),
        "k_mean_norm_over_resid_rms": (
            mu.norm(dim=-1).squeeze(-1) / resid.pow(2).mean(-1).sqrt()
        )
        .max()
        .item(),
        "rot_coord_max_sigma": rot.abs().max().item(),
        "rot_kurtosis": (rot.pow(4).mean() / rot.pow(2).mean().pow(2)).item(),
        "q_norm_median": q.double().norm(dim=-1).median().item(),
        "max_abs_v": vd.abs().max().item(),
        "v_norm_median": vd.norm(dim=-1).median().item(),
        "logit_min": lg.min().item(),
        "logit_max": lg.max().item(),
        "logit_spread_max_minus_median": max(spread) if spread else float("nan"),
    }


def _key_scale(module, head_dim: int) -> torch.Tensor:
    """``turboquant.key_scale`` for an HF attention module (NeoX RoPE over
    the whole head, as Llama's and Gemma's; ones without ``k_norm``)."""
    from vllm.model_executor.layers.quantization.turboquant.key_scale import (
        key_channel_scale,
    )

    norm = getattr(module, "k_norm", None)
    if norm is None:
        return torch.ones(head_dim)
    w = norm.weight.detach().float()
    # HF's Gemma RMSNorms multiply by (1 + w), Qwen3's by w.
    multiplier = 1.0 + w if type(norm).__name__.startswith("Gemma") else w
    return key_channel_scale(multiplier, head_dim, is_neox_style=True)


def _answer_rows_attention(module, query, key, value, scaling):
    """The teacher-forced answer's rows (the query, after a cached prompt)
    read the prompt's keys and values quantized, as a decode step reads them
    from the cache, and the answer's own raw (``answer_decoded``: quantized
    too, but for the ``recent_raw`` tokens nearest each row)."""
    a = EMU.answer_from
    q, k, v = query[0].float(), key[0], value[0]
    rep = q.shape[0] // k.shape[0]
    layer = module.layer_idx
    kq = EMU.quant_k(k, layer).float().repeat_interleave(rep, 0)
    vq = EMU.quant_v(v, layer).float().repeat_interleave(rep, 0)
    kr = k.float().repeat_interleave(rep, 0)
    vr = v.float().repeat_interleave(rep, 0)
    n, total = q.shape[1], kq.shape[1]
    rows = torch.arange(total - n, total)[:, None]
    cols = torch.arange(total)[None, :]
    seen = cols <= rows
    raw = seen & (rows - cols < EMU.recent_raw if EMU.answer_decoded else cols >= a)
    sc_q = torch.einsum("hsd,htd->hst", q, kq) * scaling
    sc_r = torch.einsum("hsd,htd->hst", q, kr) * scaling
    scores = torch.where(raw, sc_r, sc_q).masked_fill(~seen, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("hst,htd->shd", p * raw, vr)
    out = out + torch.einsum("hst,htd->shd", p * ~raw, vq)
    return out.to(query.dtype).unsqueeze(0).contiguous(), None


def tq_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """HF attention interface: [B, H, S, D] in, [B, S, H, D] out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = module.layer_idx
    if kw.get("sliding_window") and EMU.sliding:
        q = quant_sliding(query, "e4m3") if EMU.sliding == "e4m3q" else query
        return sdpa_attention_forward(
            module,
            q,
            quant_sliding(key, EMU.sliding),
            quant_sliding(value, EMU.sliding),
            attention_mask,
            scaling=scaling,
            **kw,
        )
    if layer not in EMU.layers and EMU.stats is None and EMU.capture is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kw
        )
    if kw.get("sliding_window"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kw
        )
    assert query.shape[0] == 1
    q, k, v = query[0], key[0], value[0]
    if EMU.stats is not None:
        _record_stats(layer, q, k, v, scaling)
    if EMU.capture is not None:
        EMU.capture[layer] = (q.clone(), k.clone(), v.clone(), scaling)
    if layer not in EMU.layers:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kw
        )
    if layer not in EMU.key_scale:
        EMU.key_scale[layer] = _key_scale(module, k.shape[-1])
    s = q.shape[1]
    rep = q.shape[0] // k.shape[0]
    if EMU.answer_from is not None:
        return _answer_rows_attention(module, query, key, value, scaling)
    kq = EMU.quant_k(k, layer).float().repeat_interleave(rep, 0)
    vq = EMU.quant_v(v, layer).float().repeat_interleave(rep, 0)
    kr = k.float().repeat_interleave(rep, 0)
    vr = v.float().repeat_interleave(rep, 0)
    q = q.float()
    pos = torch.arange(s)
    chunk = pos // EMU.chunk
    causal = pos[None, :] <= pos[:, None]
    cached = chunk[None, :] < chunk[:, None]  # key from an earlier chunk
    raw = causal & ~cached
    sc_raw = torch.einsum("hsd,htd->hst", q, kr) * scaling
    sc_q = torch.einsum("hsd,htd->hst", q, kq) * scaling
    scores = torch.where(cached, sc_q, sc_raw).masked_fill(~causal, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("hst,htd->hsd", p * raw, vr)
    out = out + torch.einsum("hst,htd->hsd", p * cached, vq)
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


# ----------------------------------------------------- real kernels (CPU)


def check_kernels(captured: dict, tokens: int, queries: int) -> dict:
    """Store the captured K/V of each layer with the backend's real store
    kernel and attend with its real decode kernel (Triton interpreter, fp32);
    compare with this module's float64 emulation.

    Returns per (preset, layer): max |K - K_emul| / max |K|, the same for V,
    the number of non-finite bytes decoded, and the decode output's max error
    relative to max |out| against float64 attention over the emulated K/V.
    """
    from tests.kernels.attention.turboquant_packed import dequantize
    from tests.kernels.attention.turboquant_store_args import store_kwargs
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )
    from vllm.v1.attention.ops.triton_turboquant_store_fused import (
        turboquant_store,
    )

    page = 16
    out = {}
    for preset, (kb, vb, nc) in PRESETS.items():
        cfg = TurboQuantConfig.from_cache_dtype(f"turboquant_{preset}", 0)
        for layer, (q, k, v, scaling) in captured.items():
            d = k.shape[-1]
            cfg = TurboQuantConfig.from_cache_dtype(f"turboquant_{preset}", d)
            kt = k[:, :tokens].transpose(0, 1).contiguous().float()  # [N, Hk, D]
            vt = v[:, :tokens].transpose(0, 1).contiguous().float()
            n, hk = kt.shape[:2]
            blocks = math.ceil(n / page) + 1
            cache = torch.zeros(
                blocks, page, hk, cfg.slot_size_aligned, dtype=torch.uint8
            )
            slots = torch.arange(page, page + n, dtype=torch.int64)  # block 0 unused
            cents, mids = _centroids(d, cfg.centroid_bits)
            H = _build_hadamard(d, "cpu")
            turboquant_store(
                kt,
                vt,
                cache,
                slots,
                H,
                mids.float(),
                **store_kwargs(cfg),
            )
            rows = cache.view(-1, hk, cfg.slot_size_aligned)[page : page + n]
            k_got, v_got = dequantize(rows, cfg, cents.float(), d)
            if not cfg.key_fp8:
                k_got = k_got @ H.double()  # back from rotated space
            k_emu = quant_keys_fp8(kt) if kb == 8 else quant_keys_mse(kt, kb, nc)
            v_emu = quant_values(vt, vb)
            # decode: the last `queries` positions attend to all n tokens
            qq = q[:, n - queries : n].transpose(0, 1).contiguous().float()
            table = torch.arange(1, blocks, dtype=torch.int32)[None].expand(queries, -1)
            seq = torch.arange(n - queries + 1, n + 1, dtype=torch.int32)
            got = triton_turboquant_decode_attention(
                query=qq,
                kv_cache=cache,
                block_table=table.contiguous(),
                seq_lens=seq,
                Pi=H,
                centroids=cents.float(),
                scale=scaling,
                **store_kwargs(cfg),
                norm_correction=cfg.norm_correction,
                PiT=H,
            ).double()
            rep = qq.shape[1] // hk
            ref = torch.empty_like(got)
            for i in range(queries):
                m = int(seq[i])
                kk = k_emu[:m].repeat_interleave(rep, 1)  # [m, Hq, D]
                vv = v_emu[:m].repeat_interleave(rep, 1)
                sc = torch.einsum("hd,mhd->hm", qq[i].double(), kk) * scaling
                ref[i] = torch.einsum("hm,mhd->hd", sc.softmax(-1), vv)
            out[f"{preset}@L{layer}"] = {
                "k_err_rel": ((k_got - k_emu).abs().max() / k_emu.abs().max()).item(),
                "v_err_rel": ((v_got - v_emu).abs().max() / v_emu.abs().max()).item(),
                "nonfinite_decoded": int(
                    (~k_got.isfinite()).sum() + (~v_got.isfinite()).sum()
                ),
                "decode_err_rel": ((got - ref).abs().max() / ref.abs().max()).item(),
            }
            print(
                f"  {preset}@L{layer}: "
                + ", ".join(
                    f"{a}={b:.3g}" for a, b in out[f"{preset}@L{layer}"].items()
                ),
                flush=True,
            )
    return out


# ------------------------------------------------------------------ evaluation


def load_emulated(model: str, bf16: bool = False):
    """A converted real checkpoint (a path, or a name ``checkpoints`` builds
    offline) in fp32 (``bf16``: bf16), its attention routed through
    ``tq_attention``: (path, model, tokenizer)."""
    import transformers
    from transformers.masking_utils import sdpa_mask

    from tests.models.real_weights import checkpoints

    torch.set_grad_enabled(False)
    path = Path(model)
    if not path.exists():
        path = checkpoints.build(model, offline=True)
    lm, tok = checkpoints.load(path)
    if bf16:
        lm = lm.to(torch.bfloat16)
    transformers.AttentionInterface.register("tq_emul", tq_attention)
    transformers.AttentionMaskInterface.register("tq_emul", sdpa_mask)
    lm.set_attn_implementation("tq_emul")
    return path, lm, tok


def random_ids(lm, tok, count: int) -> tuple[list[int], str]:
    """``count`` uniform random token ids (seed 0) after the tokenizer's own
    prefix (Gemma's BOS, as ``tok(text)`` adds), special ids left out: a
    calibration prompt that needs no text; and a line naming it."""
    prefix = tok("").input_ids
    vocab = min(len(tok), lm.get_input_embeddings().num_embeddings)
    allowed = torch.tensor(sorted(set(range(vocab)) - set(tok.all_special_ids)))
    g = torch.Generator().manual_seed(0)
    pick = torch.randint(0, len(allowed), (count,), generator=g)
    return prefix + allowed[pick].tolist(), (
        f"uniform random ids (seed 0, {len(allowed)} non-special)"
    )


def corpus_windows(tokenizer, window: int, count: int) -> list[torch.Tensor]:
    text = "\n\n".join(
        Path("/usr/share/common-licenses", n).read_text(errors="replace")
        for n in LICENCES
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    prefix = (
        [bos] if bos is not None and "gemma" in type(tokenizer).__name__.lower() else []
    )
    body = window - len(prefix)
    out = []
    for i in range(count):
        chunk = ids[i * body : (i + 1) * body]
        if len(chunk) < body:
            break
        out.append(torch.tensor([prefix + chunk]))
    return out


@torch.inference_mode()
def window_nll(lm, ids: torch.Tensor) -> tuple[float, int, torch.Tensor]:
    """(sum NLL over tokens 1.., count, greedy argmax ids)."""
    hidden = lm.model(input_ids=ids).last_hidden_state[0]
    head = lm.get_output_embeddings()
    total, greedy = 0.0, []
    target = ids[0, 1:]
    for a in range(0, hidden.shape[0] - 1, 256):
        b = min(a + 256, hidden.shape[0] - 1)
        logits = head(hidden[a:b]).float()
        cap = getattr(lm.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        total += torch.nn.functional.cross_entropy(
            logits, target[a:b], reduction="sum"
        ).item()
        greedy.append(logits.argmax(-1))
    return total, hidden.shape[0] - 1, torch.cat(greedy)


def needle_cases(
    tokenizer, lengths: list[int], per_cell: int, corpus: str | None = None
) -> list:
    """The quality harness's needle cases (same seeds and prompts) over its
    default corpus, or ``corpus`` (a file, as its ``--corpus``)."""
    from tests.benchmarks import import_benchmark

    inputs = import_benchmark("benchmarks.quality.kvq_inputs")
    paths = inputs.DEFAULT_CORPUS if corpus is None else [corpus]
    text, _ = inputs.read_corpus(paths, explicit=corpus is not None)
    corpus = inputs.tokenize_corpus(tokenizer, text)
    prefix = inputs.special_prefix(tokenizer)
    return inputs.needle_cases(
        corpus, tokenizer, prefix, lengths, inputs.DEPTHS, per_cell
    )


def case_label(case) -> str:
    """A needle case as ``--needle-cases`` and the missed lists name it."""
    return f"{case.length}@{case.depth}#{case.index}"


def needle_answer(tokenizer, case) -> list[int]:
    """The ids a hit starts with: " " and the needle's digits."""
    return tokenizer(" " + case.number, add_special_tokens=False).input_ids


@torch.inference_mode()
def needle_prompt(lm, tokenizer, case):
    """The prompt's raw forward, its KV cache kept, and the answer's ids: " "
    and the needle's digits."""
    from transformers import DynamicCache

    cache = DynamicCache()
    # No quantized layers: the previous configuration's would otherwise run
    # the prompt chunk-quantized (and slowly) for every case but the first.
    EMU.answer_from, EMU.layers = None, set()
    lm.model(input_ids=torch.tensor([case.prompt]), past_key_values=cache)
    return cache, needle_answer(tokenizer, case)


@torch.inference_mode()
def needle_digits(lm, case, cache, answer) -> tuple[int, float]:
    """Answer tokens predicted right with the answer teacher-forced after the
    cached prompt (all right is the greedy hit the harness counts), and the
    answer's NLL in nats. The prompt attended raw; the answer's rows read its
    keys and values quantized: the retrieval step alone."""
    n = len(case.prompt)
    ids = torch.tensor([case.prompt[-1:] + answer[:-1]])
    cache.crop(n - 1)
    EMU.answer_from = n - 1
    try:
        out = lm.model(input_ids=ids, past_key_values=cache).last_hidden_state
    finally:
        EMU.answer_from = None
    return _tokens_right(lm, out[0], answer)


@torch.inference_mode()
def needle_digits_chunked(lm, case, answer) -> tuple[int, float]:
    """``needle_digits`` with the whole prompt prefilled in chunks as the
    harness runs it: every row reads earlier chunks' keys and values
    quantized. The prompt fills whole chunks when its length is a multiple
    of the chunk, so the answer's rows read all of it quantized."""
    ids = torch.tensor([case.prompt + answer[:-1]])
    out = lm.model(input_ids=ids).last_hidden_state[0, len(case.prompt) - 1 :]
    return _tokens_right(lm, out, answer)


def _tokens_right(lm, hidden: torch.Tensor, answer: list[int]) -> tuple[int, float]:
    """How many of the rows' greedy tokens are the answer's, and the
    answer's NLL under them (nats; it moves by degrees where a hit flips)."""
    logits = lm.get_output_embeddings()(hidden).float()
    target = torch.tensor(answer)
    nll = -logits.log_softmax(-1).gather(-1, target[:, None]).sum()
    return int((logits.argmax(-1) == target).sum().item()), nll.item()


def default_layers(config, boundary: int) -> list[int]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * (
        config.num_hidden_layers
    )
    n = len(types)
    b = min(boundary, n // 2)
    skip = set(range(b)) | set(range(n - b, n))
    return [
        i for i, t in enumerate(types) if t != "sliding_attention" and i not in skip
    ]


def configurations(
    presets: list[str],
    parts: list[str],
    layers: list[int],
    fixes: list[str],
    per_layer: bool = False,
    upgraded: tuple[int, ...] = (),
    upgrade_each: bool = False,
    fixes_only: bool = False,
) -> list[tuple[str, list[int], int, int, bool, str, tuple[int, ...]]]:
    """What a run measures, in order: (name, quantized layers, key bits,
    value bits, norm correction, fix, upgraded layers). ``auto`` first; per
    preset and part the plain configuration and its fixes, each followed by
    its layers alone (``per_layer``, the plain one) and by itself with each
    layer upgraded in turn (``upgrade_each``); ``fixes_only`` leaves the plain
    configurations out where a preset has fixes."""
    configs = [("auto", [], 0, 0, True, "", ())]
    for p in presets:
        kb, vb, nc = CONFIGS[p]
        for part in parts:
            name = f"{p}:{part}"
            kbits, vbits = kb if "k" in part else 0, vb if "v" in part else 0
            variants = [(name, kbits, vbits, "")]
            if kb != 8 and kbits:
                variants += [(f"{name}+{fix}", kb, vbits, fix) for fix in fixes]
                if fixes_only and fixes:
                    variants = variants[1:]
            for vname, vk, vv, fix in variants:
                if upgraded:
                    vname += "^" + "+".join(map(str, upgraded))
                configs.append((vname, layers, vk, vv, nc, fix, upgraded))
                if not fix and per_layer and len(layers) > 1:
                    configs += [
                        (f"{name}@L{li}", [li], vk, vv, nc, "", ()) for li in layers
                    ]
                if upgrade_each:
                    configs += [
                        (f"{vname}^{li}", layers, vk, vv, nc, fix, (*upgraded, li))
                        for li in layers
                        if li not in upgraded
                    ]
    return configs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3_270m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--presets", default="k8v4,4bit_nc,k3v4_nc,3bit_nc")
    ap.add_argument("--parts", default="kv,k,v", help="kv, k (keys only), v")
    ap.add_argument(
        "--layers", default="default", help="default | all | comma list of indices"
    )
    ap.add_argument("--per-layer", action="store_true", help="also each layer alone")
    ap.add_argument(
        "--fixes",
        default="",
        help="comma list: mean,mean512,calib,calib0,calibraw,calibks0,calibmin,"
        "calibksmin,calibany,calibksany,calibrot,calibrotb,sign,chan,sink,kscale; "
        "a calib* fix with "
        "'+v' (calibksmin+v) also stores values minus their calibrated mean; "
        "any fix with '+vr' stores values Hadamard-rotated",
    )
    ap.add_argument(
        "--calib-file",
        default="/usr/share/common-licenses/Apache-2.0",
        metavar="FILE",
        help="for the calib fix: the text whose key means are subtracted",
    )
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument(
        "--calib-ids",
        choices=["text", "random"],
        default="text",
        help="calibrate on --calib-file (text) or on --calib-tokens uniform "
        "random token ids (random: no text needed)",
    )
    ap.add_argument("--stats", action="store_true")
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="run the model in bf16, as the GPU engines do (attention math in fp32)",
    )
    ap.add_argument(
        "--needle",
        default="",
        metavar="LENGTHS",
        help="needle recall of the retrieval step instead of perplexity: comma "
        "list of prompt lengths, the quality harness's cases",
    )
    ap.add_argument("--needles-per-cell", type=int, default=3)
    ap.add_argument(
        "--needle-cases",
        default="",
        metavar="CASES",
        help="with --needle: only these cases, a comma list as the output names "
        "missed ones (LENGTH@DEPTH#INDEX), e.g. a GPU run's misses",
    )
    ap.add_argument(
        "--needle-corpus",
        default=None,
        metavar="FILE",
        help="the harness run's --corpus, for the same cases as that run",
    )
    ap.add_argument(
        "--needle-chunked",
        action="store_true",
        help="with --needle: prefill the whole prompt in --chunk chunks, every row "
        "reading earlier chunks quantized (slow: a full forward per configuration)",
    )
    ap.add_argument(
        "--needle-decoded",
        action="store_true",
        help="with --needle (not chunked): the answer's rows read the answer's "
        "own tokens quantized too, as the engine's decode steps do",
    )
    ap.add_argument(
        "--recent-raw",
        type=int,
        default=0,
        metavar="W",
        help="with --needle-decoded: each answer row reads the W tokens nearest "
        "it (itself included) raw, as a recent window kept at the model dtype",
    )
    ap.add_argument(
        "--upgrade",
        default="",
        metavar="LAYERS",
        help="comma list of quantized layers stored as --upgrade-preset in every "
        "quantized configuration",
    )
    ap.add_argument(
        "--upgrade-each",
        action="store_true",
        help="also each configuration with one more layer upgraded, layer by layer",
    )
    ap.add_argument(
        "--fixes-only",
        action="store_true",
        help="leave out the plain preset where --fixes gives its fixes",
    )
    ap.add_argument(
        "--upgrade-preset",
        default="4bit_nc",
        choices=sorted(CONFIGS),
        help="what upgraded layers store: the preset as vLLM serves it (an MSE "
        "preset with rotated values, patch 0028)",
    )
    ap.add_argument(
        "--sliding",
        default="",
        metavar="FORMATS",
        help="comma list of sliding-window-layer cache formats ("
        + "; ".join(f"{k}: {v}" for k, v in SLIDING_FORMATS.items())
        + "): each alone and beside every quantized configuration",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--check-kernels",
        type=int,
        default=0,
        metavar="N",
        help="store the first N tokens of window 0 with the real Triton store "
        "kernel (interpreter) and decode them; compare with the emulation",
    )
    args = ap.parse_args(argv)

    path, lm, tok = load_emulated(args.model, args.bf16)
    cfg = lm.config
    if args.layers == "default":
        layers = default_layers(cfg, 2)
    elif args.layers == "all":
        layers = default_layers(cfg, 0)
    else:
        layers = [int(x) for x in args.layers.split(",")]
    windows = corpus_windows(tok, args.window, args.windows)
    EMU.chunk = args.chunk
    EMU.answer_decoded = args.needle_decoded
    EMU.recent_raw = args.recent_raw
    print(f"model {path.name}: quantized layers {layers}, {len(windows)} windows")

    upgraded = [int(x) for x in args.upgrade.split(",") if x]
    if not set(upgraded) <= set(layers):
        ap.error(f"--upgrade: {sorted(set(upgraded) - set(layers))} not quantized")
    ukb, uvb, _ = CONFIGS[args.upgrade_preset]
    # The upgraded layers' own preset, as vLLM serves it: rotated values on
    # MSE keys (0028), no key offset (0027 is for 3-bit keys).
    up_preset = (ukb, uvb, "+vr" if ukb != 8 else "")
    configs = configurations(
        [x for x in args.presets.split(",") if x != "none"],
        args.parts.split(","),
        layers,
        list(filter(None, args.fixes.split(","))),
        per_layer=args.per_layer,
        upgraded=tuple(upgraded),
        upgrade_each=args.upgrade_each,
        fixes_only=args.fixes_only,
    )

    formats = [f for f in args.sliding.split(",") if f]
    unknown = sorted(set(formats) - set(SLIDING_FORMATS))
    if unknown:
        ap.error(f"--sliding: {unknown} not among {sorted(SLIDING_FORMATS)}")
    configs, sliding_of = sliding_variants(configs, formats)

    results = {}
    base_greedy = []
    if any(f.startswith("calib") for f in args.fixes.split(",")):
        # Post-RoPE keys as cached, of a text that is not the evaluated one,
        # attended raw; only the layers that capture (full attention) count.
        if args.calib_ids == "random":
            ids, source = random_ids(lm, tok, args.calib_tokens)
        else:
            text = Path(args.calib_file).read_text(errors="replace")
            ids, source = tok(text).input_ids, args.calib_file
        ids = torch.tensor([ids[: args.calib_tokens]])
        EMU.capture, EMU.layers = {}, set()
        lm.model(input_ids=ids)
        EMU.calib = {
            li: c[1].double().mean(-2, keepdim=True) for li, c in EMU.capture.items()
        }
        EMU.vcalib = {
            li: c[2].double().mean(-2, keepdim=True) for li, c in EMU.capture.items()
        }
        rotary = lm.model.rotary_emb
        inv = getattr(rotary, "full_attention_inv_freq", None)
        EMU.inv_freq = rotary.inv_freq if inv is None else inv
        EMU.calib_pre = {
            li: rope(c[1].double(), -torch.arange(c[1].shape[-2]), EMU.inv_freq).mean(
                -2, keepdim=True
            )
            for li, c in EMU.capture.items()
        }
        EMU.capture = None
        print(f"calib: {ids.shape[1]} tokens of {source}")
    if args.stats:
        EMU.stats = {}
        EMU.layers = set()
        window_nll(lm, windows[0])
        print("stats (window 0):")
        for li, st in sorted(EMU.stats.items()):
            print(f"  layer {li}: " + ", ".join(f"{k}={v:.4g}" for k, v in st.items()))
        results["stats"] = {str(k): v for k, v in EMU.stats.items()}
        EMU.stats = None
    if args.check_kernels:
        EMU.capture, EMU.layers = {}, set()
        window_nll(lm, windows[0][:, : args.check_kernels])
        captured = {li: EMU.capture[li] for li in layers}
        EMU.capture = None
        print(f"real store/decode kernels vs emulation ({args.check_kernels} tokens):")
        results["kernels"] = check_kernels(captured, args.check_kernels, 4)
        if args.presets == "none":
            configs = []
    if args.needle:
        lengths = [int(x) for x in args.needle.split(",")]
        cases = needle_cases(tok, lengths, args.needles_per_cell, args.needle_corpus)
        if args.needle_cases:
            only = set(args.needle_cases.split(","))
            cases = [c for c in cases if case_label(c) in only]
            if len(cases) != len(only):
                known = {case_label(c) for c in cases}
                ap.error(f"--needle-cases: no such case {sorted(only - known)}")
        from tests.benchmarks import import_benchmark

        measures = import_benchmark("benchmarks.quality.kvq_measures")
        right = {name: [] for name, *_ in configs}
        t0 = time.time()
        for c in cases:
            if args.needle_chunked:  # every configuration runs the whole prompt
                answer = needle_answer(tok, c)
            else:
                cache, answer = needle_prompt(lm, tok, c)
            for config in configs:
                name = config[0]
                EMU.configure(config, up_preset)
                EMU.sliding = sliding_of.get(name, "")
                got = (
                    needle_digits_chunked(lm, c, answer)
                    if args.needle_chunked
                    else needle_digits(lm, c, cache, answer)
                )
                right[name].append((*got, len(answer)))
        print(f"{len(cases)} needle cases, {time.time() - t0:.0f}s", flush=True)
        for name, scores in right.items():
            hits = [r == n for r, _, n in scores]
            digits = sum(r for r, _, _ in scores) / sum(n for _, _, n in scores)
            missed = [case_label(c) for c, h in zip(cases, hits) if not h]
            nll = [x for _, x, _ in scores]
            gap = measures.paired_difference([x for _, x, _ in right["auto"]], nll)
            results[name] = {
                "recall": sum(hits) / len(hits),
                "answer_tokens_right": digits,
                "answer_nll": nll,
                "answer_nll_vs_auto": gap,
                "missed": missed,
            }
            print(
                f"{name:24s} recall {100 * sum(hits) / len(hits):5.1f}%  answer "
                f"tokens right {100 * digits:5.1f}%  answer nats vs auto "
                f"{gap['mean']:+.3f} +- {gap['se']:.3f}  missed {' '.join(missed)}",
                flush=True,
            )
        configs = []
    for config in configs:
        name = config[0]
        t0 = time.time()
        EMU.configure(config, up_preset)
        EMU.sliding = sliding_of.get(name, "")
        nll, n, agree, per = 0.0, 0, 0, []
        for w, ids in enumerate(windows):
            s, c, g = window_nll(lm, ids)
            nll, n = nll + s, n + c
            per.append(math.exp(s / c))
            if name == "auto":
                base_greedy.append(g)
            agree += int((g == base_greedy[w]).sum())
        ppl = math.exp(nll / n)
        base = results.get("auto", {}).get("ppl", ppl)
        base_w = results.get("auto", {}).get("windows", per)
        ratios = [a / b for a, b in zip(per, base_w)]
        results[name] = {
            "ppl": ppl,
            "ratio": ppl / base,
            "windows": per,
            "greedy_agree": agree / n,
        }
        print(
            f"{name:24s} ppl {ppl:8.4f}  x{ppl / base:.4f}  "
            f"argmax-agree {agree / n:.3f}  per window x"
            + " x".join(f"{r:.3f}" for r in ratios)
            + f"  ({time.time() - t0:.0f}s)",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
