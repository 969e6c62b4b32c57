# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt token ids checked against the vocabulary before they reach a GPU.

An id outside the embedding table is an out-of-bounds read in the embedding
or attention kernels: a device-side assert that takes the whole engine (and
``vllm serve`` with it) down for every request in flight. Requests that come
as token ids (``--skip-tokenizer-init``, RL rollouts, routers that tokenize
upstream) must be refused one by one, with a message that says which id.
"""

from collections.abc import Sequence
from typing import Literal

from vllm.exceptions import VLLMValidationError


def largest_valid_token_id(
    model_vocab_size: int, tokenizer_max_token_id: int | None
) -> int:
    """The largest id a prompt may hold.

    With a tokenizer, the larger of its ids and the model's: some models'
    language heads have ids the tokenizer lacks (Qwen3), some tokenizers
    have multimodal placeholder ids the head lacks. Without one, the
    model's vocabulary alone.
    """
    if tokenizer_max_token_id is None:
        return model_vocab_size - 1
    return max(tokenizer_max_token_id, model_vocab_size - 1)


def check_prompt_token_ids(
    prompt_ids: Sequence[int],
    largest_id: int,
    prompt_type: Literal["encoder", "decoder"],
) -> None:
    """Raise ``VLLMValidationError`` (HTTP 400 in the OpenAI server) naming
    the first id outside ``0..largest_id`` and its position."""
    if not prompt_ids:
        return
    if min(prompt_ids) >= 0 and max(prompt_ids) <= largest_id:
        return
    pos, bad = next(
        (i, t) for i, t in enumerate(prompt_ids) if not 0 <= t <= largest_id
    )
    raise VLLMValidationError(
        f"Token id {bad} at position {pos} of the {prompt_type} prompt is out of "
        f"vocabulary: this model takes token ids 0 to {largest_id}. Send ids "
        "from the model's own tokenizer, or the prompt as text.",
        parameter="prompt_token_ids",
        value=bad,
    )
