# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How far a trained model's MSE keys are from what a scalar code of their
bits can do: the product's codebook against one fitted to the model's keys.

TurboQuant codes each coordinate of a key's Hadamard-rotated unit vector with
a Lloyd-Max codebook computed for coordinates of a random direction
(``fp16_centroids``). Real keys are not random directions: if their rotated
coordinates were heavy-tailed or of unequal spread, a codebook fitted to them
(Lloyd's algorithm, one per layer) or a per-coordinate scale (one per KV head
and coordinate, the query multiplied by it) would code them with less error
at the same bits, and the engine could fit either at start-up, where patch
0027 already calibrates its key offsets on random ids.

For each full-attention layer of a converted real checkpoint, keys minus
their calibrated per-head mean (0027's offset) are coded these ways, with norm
correction as the ``_nc`` presets: the product's codebook (``product``), a
codebook fitted to the calibration keys (``fitted``), the product's codebook
after a per-coordinate scale fitted to them (``scaled``), both (``both``), the
product's codebook and decode after a store that searches a scale per key
(``searched``) and, at 3 bits, the emulator's codes of coordinate pairs
(``pairs``: 64 points, ``k3p2_nc``; ``pairs16``: 16 points and two signs,
``k3p2m_nc``; ``pairs_searched``: ``pairs`` after the same search). Fits read
a calibration prompt of random ids; errors are measured
on a window of the quality corpus that the fits did not see (its first key,
the attention sink 0027 treats apart, left out). Printed per layer: the
relative key error ``|k_hat - k|^2 / |k - mu|^2``, the std of the logit
error ``scale * q . (k_hat - k)`` over real queries, the rotated coordinates'
RMS spread (max / min over coordinates, 1 for equal spread) and their
kurtosis (3 for a Gaussian).

Cost (2 CPU cores): SmolLM2-135M ~35 s, Gemma-3-270M ~30 s.

    CUDA_VISIBLE_DEVICES= .venv/bin/python \\
        -m tests.models.real_weights.key_code_bound --model smollm2_135m --bits 3
"""

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import torch

from tests.models.real_weights import emulate_kv_quant as emu

CODES = ("product", "fitted", "scaled", "both", "searched")
CODES += ("pairs", "pairs16", "pairs_searched")  # 3-bit only: see fit_codes


def lloyd_max(samples: torch.Tensor, start: torch.Tensor, iters: int = 30):
    """A scalar codebook fitted to ``samples`` by Lloyd's algorithm from
    ``start`` (sorted centroids); a level no sample falls in keeps its
    value."""
    c = start.double().clone()
    x = samples.double().flatten()
    for _ in range(iters):
        idx = torch.bucketize(x, (c[:-1] + c[1:]) / 2)
        sums = torch.zeros_like(c).index_add_(0, idx, x)
        counts = torch.bincount(idx, minlength=len(c)).double()
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    return c.sort().values


def code_scaled(u: torch.Tensor, codebook, coord_scale) -> torch.Tensor:
    """``u``'s coordinates divided by ``coord_scale`` ([Hk, 1, D]) before the
    code and multiplied after (a query times it scores the same)."""
    z = u / coord_scale
    y = emu.unit_scalar(z / z.norm(dim=-1, keepdim=True), codebook) * coord_scale
    return y / y.norm(dim=-1, keepdim=True)


def coded_keys(k, mu, h, code, key_scale=1.0) -> torch.Tensor:
    """Keys [Hk, T, D] minus ``mu`` and divided by ``key_scale`` (0024's
    per-channel scale, as the store divides them), rotated by ``h``, coded by
    ``code`` (rotated unit vectors -> coded unit vectors), and back."""
    x = (k.double() - mu) / key_scale
    norm = x.norm(dim=-1, keepdim=True)
    return (code((x / norm) @ h) @ h.T) * norm * key_scale + mu


def fit_codes(k_calib: torch.Tensor, mu: torch.Tensor, h, start, key_scale=1.0):
    """``CODES``, fitted to ``k_calib`` where they fit anything; the pair
    codes only where ``start`` is the 3-bit codebook they spend the bits of."""
    x = (k_calib.double() - mu) / key_scale
    u = (x / x.norm(dim=-1, keepdim=True)) @ h
    d = u.shape[-1]
    scale = u.pow(2).mean(-2, keepdim=True).sqrt() * math.sqrt(d)
    fitted = lloyd_max(u, start)
    codes = {
        "product": functools.partial(emu.unit_scalar, c=start),
        "fitted": functools.partial(emu.unit_scalar, c=fitted),
        "scaled": functools.partial(code_scaled, codebook=start, coord_scale=scale),
        "both": functools.partial(
            code_scaled, codebook=lloyd_max(u / scale, start), coord_scale=scale
        ),
        "searched": functools.partial(emu.quant_unit_searched, c=start),
    }
    if len(start) == 8:
        codes["pairs"] = emu.unit_pairs
        codes["pairs16"] = functools.partial(emu.unit_pairs, mirrored=True)
        codes["pairs_searched"] = functools.partial(
            emu.nearest_direction, code=emu.unit_pairs
        )
    return codes


def layer_errors(q, k, scaling, mu, codes, h, key_scale=1.0) -> dict:
    """Per code: relative key error and logit-error std on ``k`` [Hk, T, D]
    with queries ``q`` [Hq, T, D]; plus the coded coordinates' spread and
    kurtosis."""
    kd = k.double()
    rep = q.shape[0] // k.shape[0]
    qs = q.double()[:, ::16]
    out = {}
    for name, code in codes.items():
        err = coded_keys(k, mu, h, code, key_scale) - kd
        rel = err.pow(2).sum(-1) / (kd - mu).pow(2).sum(-1)
        logit = torch.einsum("hsd,htd->hst", qs, err.repeat_interleave(rep, 0))
        out[name] = {
            "rel_err": rel.mean().item(),
            "logit_err_std": (logit * scaling).std().item(),
        }
    x = (kd - mu) / key_scale
    u = (x / x.norm(dim=-1, keepdim=True)) @ h * math.sqrt(k.shape[-1])
    rms = u.pow(2).mean(-2).sqrt()
    out["coord_rms_max_over_min"] = (rms.amax(-1) / rms.amin(-1)).max().item()
    out["kurtosis"] = (u.pow(4).mean() / u.pow(2).mean().pow(2)).item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--bits", type=int, choices=[2, 3, 4], default=3)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=2000)
    ap.add_argument(
        "--key-scale",
        action="store_true",
        help="divide the keys by 0024's per-channel key scale before every code "
        "and multiply after, as the product's store and decode do",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    path, lm, tok = emu.load_emulated(args.model)

    ids, source = emu.random_ids(lm, tok, args.calib_tokens)
    emu.EMU.layers, emu.EMU.capture = set(), {}
    lm.model(input_ids=torch.tensor([ids]))
    calib = emu.EMU.capture
    emu.EMU.capture = {}
    lm.model(input_ids=emu.corpus_windows(tok, args.window, 1)[0])
    evaluated = emu.EMU.capture
    emu.EMU.capture = None

    d = next(iter(calib.values()))[1].shape[-1]
    h = emu.hadamard(d)
    start, _ = emu._centroids(d, args.bits)
    print(f"model {path.name}, {args.bits}-bit keys, head_dim {d}; fitted on "
          f"{len(ids)} {source}; measured on {args.window} corpus tokens"
          + ("; keys divided by the key scale" if args.key_scale else ""))  # fmt: skip
    layers = {}
    for li in sorted(calib):
        k_calib = calib[li][1]
        q, k, _, scaling = evaluated[li]
        mu = k_calib.double().mean(-2, keepdim=True)
        s = 1.0
        if args.key_scale:
            s = emu._key_scale(lm.model.layers[li].self_attn, d).double()
        codes = fit_codes(k_calib[:, 1:], mu, h, start, s)
        if not layers:
            names = [c for c in CODES if c in codes]
            print("layer  rel. key error (" + " ".join(names) + ")   logit error std "
                  "(same)   coord RMS max/min  kurtosis")  # fmt: skip
        res = layer_errors(q, k[:, 1:], scaling, mu, codes, h, s)
        layers[li] = res
        rel = " ".join(f"{res[c]['rel_err']:.4f}" for c in names)
        logit = " ".join(f"{res[c]['logit_err_std']:.3f}" for c in names)
        spread = f"{res['coord_rms_max_over_min']:.2f}  {res['kurtosis']:.2f}"
        print(f"{li:5d}  {rel}   {logit}   {spread}")
    mean = {
        c: {
            m: sum(r[c][m] for r in layers.values()) / len(layers)
            for m in ("rel_err", "logit_err_std")
        }
        for c in names
    }
    for c in names:
        print(f"mean {c:8s} rel. key error {mean[c]['rel_err']:.4f}, logit error "
              f"std {mean[c]['logit_err_std']:.4f}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps(
                {"model": path.name, "bits": args.bits, "layers": layers, "mean": mean},
                indent=1,
            )  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
