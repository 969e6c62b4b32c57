# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Needle-in-a-haystack built locally: no hub download, deterministic, sized in tokens.

Every sample is a filler text made of sentences drawn from small word lists, one
"special magic number" sentence (the needle) for the key the question asks about,
and optionally distractor needles for other keys. A sample's prompt is as long as the
model's tokenizer allows within ``context_length`` once ``max_gen_toks`` and
``reserve_tokens`` (BOS, chat markup) are set aside: the filler is cut at a
sentence boundary, so a prompt is at most one sentence shorter than its budget.

Everything random comes from ``random.Random(f"{seed}:{index}")``, so a sample does
not depend on how many others are built, on the tokenizer, or on the Python process.
Needle depths follow the golden-ratio sequence, so the first N samples (lm-eval's
``limit``) are spread over the whole context rather than bunched at its start.

lm-eval calls :func:`build_dataset` (``custom_dataset`` in the task YAMLs) with the
task's ``metadata`` merged with what the runner passes: ``tokenizer`` (a name or
local path for ``AutoTokenizer``) and any per-job overrides.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

DEFAULT_SEED = 1234
DEFAULT_MAX_GEN_TOKS = 32
DEFAULT_RESERVE_TOKENS = 16
_GOLDEN = 0.6180339887498949

_SUBJECTS = (
    "The archivist",
    "A ferry pilot",
    "The night baker",
    "Our neighbour",
    "The surveyor",
    "A retired teacher",
    "The lighthouse keeper",
    "The orchard manager",
    "A travelling tailor",
    "The station master",
    "The young cartographer",
    "A beekeeper",
    "The choir director",
)
_VERBS = (
    "sorted",
    "repainted",
    "measured",
    "catalogued",
    "carried",
    "repaired",
    "counted",
    "described",
    "photographed",
    "polished",
    "rearranged",
)
_OBJECTS = (
    "the old maps",
    "a crate of pears",
    "the station clock",
    "three wooden chairs",
    "the harbour ledgers",
    "a box of brass buttons",
    "the garden fence",
    "a stack of letters",
    "the copper kettles",
    "the library shelves",
    "a basket of walnuts",
    "the signal lamps",
)
_TAILS = (
    "before the rain started",
    "on a quiet Tuesday",
    "while the kettle boiled",
    "near the northern gate",
    "after the market closed",
    "without saying a word",
    "under a grey sky",
    "as the tide came in",
    "for the winter fair",
    "by the light of a lantern",
    "in less than an hour",
)
_KEY_ADJECTIVES = (
    "amber",
    "quiet",
    "crimson",
    "hollow",
    "silver",
    "patient",
    "frosty",
    "golden",
    "restless",
    "velvet",
    "distant",
    "brisk",
    "gentle",
    "wild",
)
_KEY_NOUNS = (
    "falcon",
    "harbor",
    "meadow",
    "lantern",
    "violin",
    "glacier",
    "orchard",
    "compass",
    "thimble",
    "comet",
    "quarry",
    "saddle",
    "beacon",
    "willow",
)

INSTRUCTION = (
    "A special magic number is hidden in the text below. Memorize it: you will be "
    "asked for it afterwards.\n\n"
)
QUESTION = (
    "\n\nWhat is the special magic number for {key} mentioned in the text above? "
    "Answer with the number only.\nThe special magic number for {key} is:"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."


def filler_sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
        f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
    )


def needle_depth(index: int) -> float:
    """Where sample ``index`` hides its needle, as a fraction of the filler."""
    return (index * _GOLDEN) % 1.0


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = [(a, n) for a in _KEY_ADJECTIVES for n in _KEY_NOUNS]
    return [f"{a}-{n}" for a, n in rng.sample(pairs, count)]


def _values(rng: random.Random, count: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), count)]


def _assemble(filler: list[str], needles: list[tuple[float, str]], key: str) -> str:
    """The prompt: ``filler`` with each needle inserted at its depth."""
    sentences = list(filler)
    # Deepest first, so an insertion never moves a shallower needle's position.
    for depth, text in sorted(needles, key=lambda n: -n[0]):
        sentences.insert(round(depth * len(filler)), text)
    return INSTRUCTION + " ".join(sentences) + QUESTION.format(key=key)


def make_sample(
    count_tokens: Callable[[str], int],
    index: int,
    *,
    context_length: int,
    seed: int = DEFAULT_SEED,
    num_distractors: int = 0,
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
) -> dict[str, Any]:
    """One sample whose prompt has at most ``context_length - max_gen_toks -
    reserve_tokens`` tokens by ``count_tokens``, filled as far as that allows."""
    budget = context_length - max_gen_toks - reserve_tokens
    rng = random.Random(f"{seed}:{index}")
    keys = _keys(rng, 1 + num_distractors)
    values = _values(rng, 1 + num_distractors)
    key, value = keys[0], values[0]
    depth = needle_depth(index)
    needle = NEEDLE.format(key=key, value=value)
    needles = [(depth, needle)] + [
        (rng.random(), NEEDLE.format(key=k, value=v))
        for k, v in zip(keys[1:], values[1:])
    ]
    filler: list[str] = []

    def tokens_with(n: int) -> int:
        return count_tokens(_assemble(filler[:n], needles, key))

    if (bare := tokens_with(0)) > budget:
        raise ValueError(
            f"a NIAH prompt needs {bare} tokens before any filler, but context_length "
            f"{context_length} leaves {budget} once max_gen_toks ({max_gen_toks}) and "
            f"reserve_tokens ({reserve_tokens}) are set aside; raise context_length "
            "or lower num_distractors"
        )
    # Tokenizing a 128K-token prompt takes seconds, so estimate the sentence count
    # from per-sentence counts and settle it with a few whole-prompt counts.
    estimate, total = 0, bare
    while total <= budget or len(filler) < estimate + 8:
        filler.append(filler_sentence(rng))
        total += count_tokens(" " + filler[-1])
        if total <= budget:
            estimate = len(filler)
    while True:
        fits = _largest_fitting(
            lambda n: tokens_with(n) <= budget, estimate, len(filler) + 1
        )
        if fits < len(filler):
            break
        # Joined sentences came out shorter than counted one by one: draw more.
        filler.extend(filler_sentence(rng) for _ in range(max(8, len(filler) // 8)))
        estimate = fits
    prompt = _assemble(filler[:fits], needles, key)
    return {
        "index": index,
        "input": prompt,
        "target": value,
        "key": key,
        "depth": depth,
        "filler_sentences": fits,
        "prompt_tokens": count_tokens(prompt),
        "context_length": context_length,
    }


def _largest_fitting(fits: Callable[[int], bool], guess: int, limit: int) -> int:
    """The largest n in [0, limit) with fits(n), searching outwards from ``guess``;
    fits(0) must hold, and fits must be monotone (true, then false)."""
    guess = min(max(guess, 0), limit - 1)
    if fits(guess):
        lo, step = guess, 1
        while lo + step < limit and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, limit)
    else:
        hi, step = guess, 1
        while hi - step > 0 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:  # fits(lo), and hi == limit or not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def make_samples(
    count_tokens: Callable[[str], int], num_samples: int, **kwargs: Any
) -> list[dict[str, Any]]:
    return [make_sample(count_tokens, i, **kwargs) for i in range(num_samples)]


def score(target: str, output: str) -> float:
    """1.0 when the needle's value appears in the model's answer as a whole number
    (not inside a longer one), else 0.0."""
    return float(re.search(rf"(?<!\d){re.escape(target)}(?!\d)", output) is not None)


# ---- lm-eval hooks (imported by lm-eval from the task YAMLs) ----------------------

_SAMPLE_KEYS = (
    "context_length",
    "seed",
    "num_distractors",
    "max_gen_toks",
    "reserve_tokens",
)


def build_dataset(**metadata: Any) -> dict[str, Any]:
    """``custom_dataset`` for the hybridkv_niah tasks: the test split, built offline."""
    import datasets
    from transformers import AutoTokenizer

    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not name:
        raise ValueError(
            "hybridkv_niah sizes its prompts with the model's tokenizer, but no "
            "'tokenizer' (or 'pretrained') was passed in the task metadata; pass "
            "metadata={'tokenizer': <model name or path>} to lm-eval's TaskManager"
        )
    tokenizer = AutoTokenizer.from_pretrained(
        name, trust_remote_code=bool(metadata.get("trust_remote_code", False))
    )

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    kwargs = {k: int(metadata[k]) for k in _SAMPLE_KEYS if k in metadata}
    rows = make_samples(count_tokens, int(metadata["num_samples"]), **kwargs)
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"niah_recall": score(doc["target"], results[0])}
