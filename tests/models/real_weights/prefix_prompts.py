# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompts of the prefix-cache matrix's trained cells: corpus text in the
checkpoint's own tokens.

Seeded ids from a tiny vocabulary, the prompts of the tiny checkpoints, are
no text to a trained model: SmolLM2-135M and Gemma-3-270M answered them with
one token repeated or a loop of two, at top-1/top-2 logit gaps of one bf16
step, where any rounding flips the greedy token (PREFIX_CACHING.md, the first
trained run). Text gives them something to continue. Every shared prefix is a
document start (the tokenizer's own special prefix, Gemma's ``<bos>``, then
corpus tokens from a seeded sentence start); the messages after it are corpus
passages from other seeded sentence starts.
"""

import random
from typing import Any

from benchmarks.quality.kvq_inputs import (
    DEFAULT_CORPUS,
    Corpus,
    read_corpus,
    snap_to_sentence_start,
    special_prefix,
    take,
    tokenize_corpus,
)

# Tokens of a hit request's own message after the shared prefix.
SUFFIX_TOKENS = 64


class CorpusPrompts:
    """Seeded documents and passages of one tokenizer's corpus tokens."""

    def __init__(self, corpus: Corpus, special: list[int]):
        self.corpus = corpus
        self.special = special

    @classmethod
    def from_checkpoint(cls, path: str) -> "CorpusPrompts":
        """The corpus (``corpus.LICENCE_TEXTS``) in the tokens of the
        tokenizer saved beside a converted checkpoint."""
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(path)
        text, _ = read_corpus(DEFAULT_CORPUS, explicit=False)
        return cls(tokenize_corpus(tok, text), special_prefix(tok))

    def passage(self, length: int, seed: int) -> list[int]:
        """``length`` corpus tokens from a seeded sentence start."""
        start = random.Random(seed).randrange(len(self.corpus))
        return take(self.corpus.ids, snap_to_sentence_start(self.corpus, start), length)

    def document(self, length: int, seed: int) -> list[int]:
        """A ``length``-token document start: the special prefix, then a
        passage."""
        return self.special + self.passage(length - len(self.special), seed)

    def messages(self, count: int, seed: int) -> list[list[int]]:
        """``count`` passages of ``SUFFIX_TOKENS``, each from its own seed."""
        return [self.passage(SUFFIX_TOKENS, seed + i) for i in range(count)]
