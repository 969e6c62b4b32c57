# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-quality harness's figures, from engine outputs to numbers.

Pure functions (no vLLM, no torch), shared by the engine child (perplexity
from prompt logprobs, needle hits) and the parent (recall per length,
agreement with the auto cell, ratios).

Prompt logprobs, as vLLM 0.20.2 returns them for ``prompt_logprobs=0``:
``RequestOutput.prompt_logprobs`` is one entry per prompt token, the first
``None`` (nothing predicts it), every other a mapping from token id to a
``Logprob`` (``.logprob``, ``.rank``) that holds the prompt token itself (the
model runner gathers the logprob of the actual next prompt token and adds the
top-k, here none).
"""

import math
from collections.abc import Sequence
from typing import Any


def window_nll(
    prompt: Sequence[int], prompt_logprobs: Sequence[Any], start: int = 1
) -> dict:
    """Summed negative log-likelihood of a window's tokens from ``start`` on
    (by default every token after the first, which nothing predicts).

    ``top1``: tokens the model ranked first (rank 1), where ranks are given.
    """
    if prompt_logprobs is None:
        raise ValueError("no prompt logprobs: was prompt_logprobs=0 passed?")
    if len(prompt_logprobs) != len(prompt):
        raise ValueError(
            f"{len(prompt_logprobs)} prompt logprobs for {len(prompt)} tokens"
        )
    if not 1 <= start < len(prompt):
        raise ValueError(f"no token to score from {start} of {len(prompt)}")
    nll, top1 = 0.0, 0
    for pos in range(start, len(prompt)):
        entry = prompt_logprobs[pos]
        token = prompt[pos]
        try:
            lp = entry[token]
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"position {pos}: no logprob for the prompt token {token} "
                f"(entry {entry!r:.120})"
            ) from e
        nll -= float(getattr(lp, "logprob", lp))
        top1 += getattr(lp, "rank", None) == 1
    return {"nll": nll, "tokens": len(prompt) - start, "top1": top1}


def _finite(x: float) -> float | None:
    # JSON has no inf/nan; None says "not a number" plainly.
    return x if math.isfinite(x) else None


def perplexity_summary(windows: Sequence[dict]) -> dict:
    """exp(mean NLL over every scored token of every window), and per window."""
    tokens = sum(w["tokens"] for w in windows)
    nll = sum(w["nll"] for w in windows)
    if tokens == 0:
        raise ValueError("no scored tokens")
    per_window = []
    for w in windows:
        mean = w["nll"] / w["tokens"]
        per_window.append(
            {
                "tokens": w["tokens"],
                "nll_mean": _finite(mean),
                "ppl": _finite(math.exp(mean)) if mean < 700 else None,
            }
        )
    mean = nll / tokens
    return {
        "ppl": _finite(math.exp(mean)) if mean < 700 else None,
        "nll_mean": _finite(mean),
        "tokens": tokens,
        "top1_pct": 100.0 * sum(w["top1"] for w in windows) / tokens,
        "windows": per_window,
    }


def needle_hit(number: str, text: str) -> bool:
    """A hit: the needle's number appears in the decoded answer."""
    return number in text


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a recall of ``hits`` in ``n``, in %.

    How far a recall over a few dozen needle cases can sit from the model's
    own: at 90 % over 60 cases it spans about 80-95 %, so two presets (or
    releases) that differ by a few cases are not told apart.
    """
    if n <= 0:
        raise ValueError(f"an interval needs cases, got n = {n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)


def needles_lost(ref_hits: Sequence[bool], hits: Sequence[bool]) -> dict:
    """Cases the reference (auto) found and this cell missed, and the
    reverse: on the same cases, the difference that is this cell's own."""
    if len(ref_hits) != len(hits):
        raise ValueError(f"{len(hits)} needle outcomes against {len(ref_hits)}")
    pairs = list(zip(map(bool, ref_hits), map(bool, hits)))
    return {
        "lost": sum(r and not h for r, h in pairs),
        "gained": sum(h and not r for r, h in pairs),
    }


def recall_summary(cases: Sequence[dict], hits: Sequence[bool]) -> dict:
    """Recall % overall, per length and per depth (``cases``: needle metas)."""
    if len(cases) != len(hits):
        raise ValueError(f"{len(hits)} outcomes for {len(cases)} needle cases")

    def pct(selected: list[bool]) -> float | None:
        return 100.0 * sum(selected) / len(selected) if selected else None

    per_length: dict[str, float | None] = {}
    per_depth: dict[str, float | None] = {}
    for length in dict.fromkeys(c["length"] for c in cases):
        per_length[str(length)] = pct(
            [h for c, h in zip(cases, hits) if c["length"] == length]
        )
    for depth in dict.fromkeys(c["depth"] for c in cases):
        per_depth[str(depth)] = pct(
            [h for c, h in zip(cases, hits) if c["depth"] == depth]
        )
    return {
        "recall_pct": pct(list(hits)),
        "ci95_pct": list(wilson_interval(sum(hits), len(hits))) if hits else None,
        "hits": sum(hits),
        "cases": len(hits),
        "per_length": per_length,
        "per_depth": per_depth,
    }


def answer_summary(scored: Sequence[dict]) -> dict:
    """Per needle case, the answer's NLL under teacher forcing (``window_nll``
    over the answer's tokens) and whether each of its tokens ranked first;
    their mean over the cases."""
    nll = [s["nll"] for s in scored]
    return {
        "nll": nll,
        "top1": [s["top1"] == s["tokens"] for s in scored],
        "mean_nll": sum(nll) / len(nll) if nll else None,
    }


def paired_difference(ref: Sequence[float], x: Sequence[float]) -> dict:
    """Mean of ``x - ref`` over paired cases and its standard error: a
    preset's answer NLL against auto's on the same needle cases (where a
    binary hit would flip on cases at the boundary), or its per-token NLL
    against auto's on the same perplexity windows."""
    if len(ref) != len(x) or not x:
        raise ValueError(f"{len(x)} cases paired with {len(ref)}")
    d = [b - a for a, b in zip(ref, x)]
    mean = sum(d) / len(d)
    var = sum((v - mean) ** 2 for v in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return {"mean": mean, "se": math.sqrt(var / len(d)), "cases": len(d)}


def kv_bits_per_element(layers: Sequence[dict], context: int) -> dict:
    """Bits the KV cache spends per K/V element, all extras (norms, scales,
    padding) included: each layer's page bytes per token over its ``2 x KV
    heads x head_size`` elements.

    ``quantized``: over the layers not at the model dtype, weighted by their
    elements. ``cache``: over one request's whole cache at ``context``
    tokens, where a sliding-window layer holds at most its window; the
    layers a skip list keeps at bf16 count here (issue 46's budget is this
    one). Each layer: ``kv_cache_dtype``, ``bytes_per_token``,
    ``elements_per_token``, ``sliding_window`` (None: full attention).
    None where a layer lacks its figures.
    """
    if not layers or any(
        not la.get("bytes_per_token") or not la.get("elements_per_token")
        for la in layers
    ):
        return {"quantized": None, "cache": None}

    def mean_bits(selected: list[dict], tokens) -> float | None:
        bits = sum(tokens(la) * la["bytes_per_token"] * 8 for la in selected)
        elements = sum(tokens(la) * la["elements_per_token"] for la in selected)
        return bits / elements if elements else None

    def held(la: dict) -> int:
        window = la.get("sliding_window")
        return min(context, window) if window else context

    quantized = [la for la in layers if la["kv_cache_dtype"] != "auto"]
    return {
        "quantized": mean_bits(quantized, lambda la: 1),
        "cache": mean_bits(list(layers), held),
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: Sequence[Sequence[int]], out: Sequence[Sequence[int]]) -> dict:
    """Greedy agreement of ``out`` with the reference ``ref`` (auto).

    Per prompt, the tokens equal before the first difference; summed over
    prompts and divided by the reference's token count. ``first_diff``: where
    each prompt first differs (None: equal throughout).
    """
    if len(ref) != len(out):
        raise ValueError(f"{len(out)} outputs against {len(ref)} reference ones")
    matched = [common_prefix(r, o) for r, o in zip(ref, out)]
    total = sum(len(r) for r in ref)
    equal = [list(r) == list(o) for r, o in zip(ref, out)]
    return {
        "pct": 100.0 * sum(matched) / total if total else None,
        "matched": sum(matched),
        "total": total,
        "prompts_equal": sum(equal),
        "prompts": len(ref),
        "first_diff": [None if e else m for e, m in zip(equal, matched)],
    }


def ratio(value: float | None, ref: float | None) -> float | None:
    if value is None or not ref:
        return None
    return value / ref
