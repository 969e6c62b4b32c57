# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How far prefix caching moved a trained model's logits, and whether each
greedy token it changed was a rounding flip.

A bf16 model served from a prefix-cache hit computes the message after the
prefix in a step of another shape than the cold prefill does, so its GEMMs
round differently; a greedy token whose top two logits lie within that
rounding can flip. The tiny
checkpoints' bigram chains keep their top-2 gaps far above rounding, so there
a hit must be token-exact; a trained model's are often one bf16 step.

Both engines keep their top raw logits per generated token
(``logprobs_mode="raw_logits"``, ``TOP_LOGITS`` of them: bf16 ties are often
three-way). Where the tokens so far agree and both chose the same token, the
difference of that token's logit between the engines is the drift, counted
in bf16 steps (ulps) of the logit. At a request's first different token, the
cold engine chose ``a`` and the other ``b``: the difference
``l(a) - l(b)`` moved by ``margin``, the cold engine's ``l(a) - l(b)`` plus the
other's ``l(b) - l(a)``, which two logits drifting by at most ``d`` each can
do when ``margin <= 2 d``. A changed token outside either engine's top
logits, or a margin beyond twice the largest drift, is no rounding flip; nor
is any flip where the drift itself exceeds what rounding gives
(``ROUNDING_ULPS``).
"""

import math
import statistics
from typing import Any

from .spec_decode_matrix import first_token_difference

BF16_MANTISSA_BITS = 7
# Logits kept per generated token. With two, the first run on text prompts
# could not place 3 of Gemma 3's 39 flips: three tokens tied at one bf16
# value, the new token the cold engine's third.
TOP_LOGITS = 5
# The largest drift, in bf16 ulps of the logit, counted as rounding between
# two step shapes; set before any trained run kept logits (the text runs then
# read 5-12 in auto).
ROUNDING_ULPS = 16


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at ``x``."""
    if x == 0:
        return 2.0**-133
    _, exp = math.frexp(abs(x))  # |x| = m * 2**exp, m in [0.5, 1)
    return 2.0 ** (exp - 1 - BF16_MANTISSA_BITS)


def _margin(cold: list, other: list, a: int, b: int) -> float | None:
    """Ulps the flip from ``a`` (cold) to ``b`` needed at one position, or
    None where either engine's top logits lack one of the two."""
    lc, lo = dict(map(tuple, cold)), dict(map(tuple, other))
    if not {a, b} <= lc.keys() or not {a, b} <= lo.keys():
        return None
    return ((lc[a] - lc[b]) + (lo[b] - lo[a])) / bf16_ulp(lc[a])


def flips(cold: dict[str, Any], run: dict[str, Any], idx: list[int]) -> dict:
    """Drift and flips of requests ``idx`` of ``run`` against ``cold`` (both
    records with ``outputs`` and ``top_logits``)."""
    drift: list[float] = []
    found: list[dict[str, Any]] = []
    for i in idx:
        a, b = cold["outputs"][i], run["outputs"][i]
        ta, tb = cold["top_logits"][i], run["top_logits"][i]
        t = first_token_difference(a, b)
        for k in range(min(len(a) if t is None else t, len(ta), len(tb))):
            (ida, la), (idb, lb) = ta[k][0], tb[k][0]
            if ida == idb:
                drift.append(abs(la - lb) / bf16_ulp(la))
        if t is not None:
            m = _margin(ta[t], tb[t], a[t], b[t]) if t < min(len(ta), len(tb)) else None
            found.append({"request": i, "at": t, "margin_ulps": m})
    top = max(drift, default=0.0)
    rounding = top <= ROUNDING_ULPS and all(
        f["margin_ulps"] is not None and f["margin_ulps"] <= 2 * top for f in found
    )
    return {
        "drift_ulps_median": statistics.median(drift) if drift else None,
        "drift_ulps_max": top,
        "flips": found,
        "rounding": rounding,
    }


def describe(summary: dict[str, Any] | None) -> str:
    """``drift median/max ulps, flips k (margins)``, for the table."""
    if not summary:
        return "-"
    med = summary["drift_ulps_median"]
    text = f"{0 if med is None else med:.1f}/{summary['drift_ulps_max']:.1f}"
    margins = [f["margin_ulps"] for f in summary["flips"]]
    if margins:
        shown = ",".join("-" if m is None else f"{m:.0f}" for m in margins)
        text += f", flips {len(margins)} ({shown})"
    return text
