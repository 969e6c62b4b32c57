# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prompts of the KV-quality harness, built once per model in the parent.

Everything here works on token ids from the checkpoint's own tokenizer, so
every cell of a model scores exactly the same tokens, and a needle case is
exactly as long as its grid length says. No vLLM, no torch: only a tokenizer
(``transformers.AutoTokenizer`` in the harness, a fake one in the tests).

* Corpus: plain text files joined by a blank line, tokenized without special
  tokens; every token carries whether a sentence ends with it (its text,
  stripped, ends in ``.``, ``!`` or ``?`` and whitespace follows), so a needle
  or an excerpt can start at a sentence boundary.
* Perplexity windows: the tokenizer's own special prefix (Gemma's ``<bos>``;
  SmolLM2 adds none) and then consecutive, non-overlapping corpus tokens.
* Needle cases: prefix + haystack (corpus tokens from a seeded offset, wrapping
  round the corpus) with the needle sentence after the sentence end nearest
  the depth, then the question in completion form; its answer, the number as
  the model would write it next (`` 4572641``), is kept beside it as token
  ids, to be scored under teacher forcing.
* Agreement prompts: prefix + corpus excerpts of fixed lengths at fixed
  offsets.
"""

import dataclasses
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tests.models.real_weights.corpus import LICENCE_TEXTS

DEFAULT_CORPUS = LICENCE_TEXTS
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
NEEDLE = "The secret passcode for the {word} vault is {number}."
# Completion form: a base model answers by copying the number.
QUESTION = (
    "\nQuestion: What is the secret passcode for the {word} vault?\n"
    "Answer: The secret passcode for the {word} vault is"
)
# Vault names: common, unrelated to licence prose, one word each.
WORDS = (
    "amber",
    "basalt",
    "cedar",
    "copper",
    "coral",
    "falcon",
    "garnet",
    "glacier",
    "harbor",
    "heron",
    "indigo",
    "juniper",
    "lantern",
    "maple",
    "marble",
    "meadow",
    "nickel",
    "orchid",
    "pepper",
    "pigeon",
    "quartz",
    "raven",
    "saffron",
    "sparrow",
    "thistle",
    "tulip",
    "velvet",
    "walnut",
    "willow",
    "zephyr",
)
AGREEMENT_PROMPTS = 16
AGREEMENT_SHORTEST = 200
AGREEMENT_LONGEST = 1500
_SENTENCE_END = ".!?"
_CLOSERS = "\"')]"
# How far (tokens) an offset may move to reach a sentence boundary.
_SNAP = 200


class InputError(Exception):
    """A missing or unusable input (corpus, tokenizer, grid): exit status 2."""


# ---------------------------------------------------------------- corpus


def read_corpus(paths: Sequence[str], explicit: bool) -> tuple[str, list[str]]:
    """(joined text, the files used). Files given on the command line must all
    be readable; of the default list, those that exist are used."""
    texts, used, problems = [], [], []
    for p in paths:
        try:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            problems.append(f"{p}: {e.strerror or e}")
            continue
        if not text.strip():
            problems.append(f"{p}: empty")
            continue
        texts.append(text.strip("\n"))
        used.append(str(p))
    if explicit and problems:
        raise InputError(
            "corpus file(s) not readable: "
            + "; ".join(problems)
            + ". Fix the --corpus paths (plain UTF-8 text files)."
        )
    if not texts:
        raise InputError(
            "no readable corpus: none of "
            + ", ".join(paths)
            + " could be read. Pass --corpus FILE [FILE ...] with plain English "
            "text (about 150 KB; Debian's base-files puts licence texts in "
            "/usr/share/common-licenses/)."
        )
    return "\n\n".join(texts), used


@dataclasses.dataclass
class Corpus:
    text: str
    ids: list[int]
    # ends[i]: a sentence ends with token i (a boundary lies after it).
    ends: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


def sentence_ends(spans: Sequence[str]) -> list[bool]:
    """Per token text: whether a sentence ends with it. Whitespace must follow
    the stop (in the token itself or starting the next one), so "2.1", "e.g"
    inside a word and "U.S.A" are not boundaries."""
    ends = []
    for i, span in enumerate(spans):
        core = span.rstrip().rstrip(_CLOSERS)
        nxt = spans[i + 1] if i + 1 < len(spans) else " "
        spaced = span[-1:].isspace() or nxt[:1].isspace()
        ends.append(bool(core) and core[-1] in _SENTENCE_END and spaced)
    return ends


def _token_spans(tok: Any, text: str) -> tuple[list[int], list[str]]:
    # Offsets give each token's exact text; a tokenizer without them (slow
    # ones) falls back to decoding each distinct id once.
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        spans = [text[a:b] for a, b in enc["offset_mapping"]]
        if len(spans) == len(ids):
            return ids, spans
    except (NotImplementedError, TypeError, ValueError, KeyError):
        pass
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    pieces = {i: tok.decode([i]) for i in set(ids)}
    return ids, [pieces[i] for i in ids]


def tokenize_corpus(tok: Any, text: str) -> Corpus:
    ids, spans = _token_spans(tok, text)
    if not ids:
        raise InputError("the corpus tokenizes to no tokens")
    return Corpus(text=text, ids=ids, ends=sentence_ends(spans))


def special_prefix(tok: Any) -> list[int]:
    """The ids the tokenizer puts before a text of its own accord (its BOS)."""
    plain = list(tok("Hello world", add_special_tokens=False)["input_ids"])
    full = list(tok("Hello world")["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def take(seq: Sequence[Any], start: int, n: int) -> list[Any]:
    """``n`` items of ``seq`` from ``start``, wrapping round its end."""
    out: list[Any] = []
    start %= len(seq)
    while len(out) < n:
        chunk = seq[start : start + n - len(out)]
        out.extend(chunk)
        start = 0
    return out


def snap_to_sentence_start(corpus: Corpus, pos: int) -> int:
    """The first token at or after ``pos`` that starts a sentence (within
    _SNAP tokens; else ``pos``)."""
    n = len(corpus)
    for step in range(_SNAP):
        i = (pos + step) % n
        if corpus.ends[(i - 1) % n]:
            return i
    return pos % n


# ---------------------------------------------------------------- perplexity


def ppl_windows(
    corpus: Corpus, prefix: list[int], window: int, max_windows: int
) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens (prefix included) from the
    start of the corpus, as many as it gives, at most ``max_windows``."""
    body = window - len(prefix)
    if body < 2:
        raise InputError(f"perplexity window of {window} tokens is too short")
    count = min(len(corpus) // body, max_windows)
    if count < 1:
        raise InputError(
            f"the corpus has {len(corpus)} tokens, fewer than one perplexity "
            f"window ({body} + {len(prefix)} special); give a longer --corpus "
            "or a smaller --ppl-window"
        )
    return [prefix + corpus.ids[i * body : (i + 1) * body] for i in range(count)]


# ---------------------------------------------------------------- needles


@dataclasses.dataclass
class NeedleCase:
    length: int
    depth: float
    index: int  # 0.. per (length, depth)
    word: str
    number: str
    # Corpus token where the haystack starts; the needle's first token in
    # the prompt; the needle's length in tokens.
    haystack_offset: int
    needle_at: int
    needle_tokens: int
    at_sentence_end: bool
    # The number's tokens as the continuation of the prompt (teacher forcing).
    answer: list[int]
    prompt: list[int]

    def meta(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["prompt"]
        d["prompt_tokens"] = len(self.prompt)
        return d


def _draw_number(rng: random.Random, text: str) -> str:
    # A 7-digit number the corpus does not contain, so only the needle can
    # have put it in the answer.
    while True:
        number = str(rng.randrange(1_000_000, 10_000_000))
        if number not in text:
            return number


def insertion_point(ends: Sequence[bool], depth: float) -> int:
    """Where in a haystack (its ``ends`` flags) the needle goes: before the
    token nearest ``depth`` that follows a sentence end (at most 5 % of the
    haystack or 64 tokens away); the exact depth when no sentence ends there."""
    n = len(ends)
    target = min(max(round(depth * n), 1), n - 1)
    radius = max(64, n // 20)
    best = None
    for j in range(max(1, target - radius), min(n - 1, target + radius) + 1):
        if ends[j - 1] and (best is None or abs(j - target) < abs(best - target)):
            best = j
    return target if best is None else best


def _needle_seed(sample: int, length: int, depth: float) -> str:
    # Sample 0 keeps the seeds every earlier table was measured with.
    head = "kv-quality-needle" if sample == 0 else f"kv-quality-needle-{sample}"
    return f"{head}:{length}:{depth}"


def needle_cases(
    corpus: Corpus,
    tok: Any,
    prefix: list[int],
    lengths: Iterable[int],
    depths: Iterable[float] = DEPTHS,
    per_cell: int = 3,
    sample: int = 0,
) -> list[NeedleCase]:
    """``per_cell`` cases per (length, depth), each exactly ``length`` tokens.

    Seeded by (``sample``, length, depth) alone, so a re-run (and the other
    model, up to its own tokenization) gets the same words, numbers and
    offsets; another ``sample`` draws other ones, a second sample of the
    same grid.
    """
    if per_cell > len(WORDS):
        raise InputError(f"at most {len(WORDS)} needles per length and depth")
    cases = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(_needle_seed(sample, length, depth))
            words = rng.sample(WORDS, per_cell)
            for k, word in enumerate(words):
                number = _draw_number(rng, corpus.text)
                needle = encode(tok, " " + NEEDLE.format(word=word, number=number))
                question = encode(tok, QUESTION.format(word=word))
                body = length - len(prefix) - len(needle) - len(question)
                if body < 32:
                    raise InputError(
                        f"needle length {length} leaves {body} haystack tokens"
                    )
                start = snap_to_sentence_start(corpus, rng.randrange(len(corpus)))
                hay = take(corpus.ids, start, body)
                ends = take(corpus.ends, start, body)
                j = insertion_point(ends, depth)
                prompt = prefix + hay[:j] + needle + hay[j:] + question
                cases.append(
                    NeedleCase(
                        length=length,
                        depth=depth,
                        index=k,
                        word=word,
                        number=number,
                        haystack_offset=start,
                        needle_at=len(prefix) + j,
                        needle_tokens=len(needle),
                        at_sentence_end=ends[j - 1],
                        answer=encode(tok, " " + number),
                        prompt=prompt,
                    )
                )
    return cases


# ---------------------------------------------------------------- agreement


def agreement_prompts(
    corpus: Corpus,
    prefix: list[int],
    count: int = AGREEMENT_PROMPTS,
    shortest: int = AGREEMENT_SHORTEST,
    longest: int = AGREEMENT_LONGEST,
) -> tuple[list[list[int]], list[dict[str, int]]]:
    """(prompts, their offsets and lengths): excerpts from evenly spaced
    offsets, lengths evenly spread from ``shortest`` to ``longest`` tokens."""
    prompts, meta = [], []
    for i in range(count):
        length = shortest + round(i * (longest - shortest) / max(count - 1, 1))
        start = snap_to_sentence_start(corpus, i * len(corpus) // count)
        prompts.append(prefix + take(corpus.ids, start, length - len(prefix)))
        meta.append({"offset": start, "tokens": length})
    return prompts, meta


# ---------------------------------------------------------------- all of it


def build_inputs(
    tok: Any,
    text: str,
    lengths: Sequence[int],
    ppl_window: int,
    max_windows: int,
    needles_per_cell: int,
    needle_sample: int = 0,
) -> dict[str, Any]:
    """Every prompt of one model, JSON-ready: ``prompts`` (what the engine
    gets, token ids) and ``meta`` (what the report keeps)."""
    corpus = tokenize_corpus(tok, text)
    prefix = special_prefix(tok)
    windows = ppl_windows(corpus, prefix, ppl_window, max_windows)
    cases = needle_cases(
        corpus, tok, prefix, lengths, DEPTHS, needles_per_cell, needle_sample
    )
    agree, agree_meta = agreement_prompts(corpus, prefix)
    return {
        "prompts": {
            "ppl": windows,
            "needle": [c.prompt for c in cases],
            "agreement": agree,
        },
        "meta": {
            "corpus_tokens": len(corpus),
            "special_prefix": prefix,
            "ppl": {"window_tokens": ppl_window, "windows": len(windows)},
            "needle": {
                "lengths": list(lengths),
                "depths": list(DEPTHS),
                "per_length_depth": needles_per_cell,
                "sample": needle_sample,
                "cases": [c.meta() for c in cases],
            },
            "agreement": {"prompts": agree_meta},
        },
    }
