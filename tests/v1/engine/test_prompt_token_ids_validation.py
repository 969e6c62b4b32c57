# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt token ids outside the vocabulary are refused per request.

0.20.2 compared prompt ids with the vocabulary only when a tokenizer was
loaded, and only their maximum: with ``--skip-tokenizer-init`` (or any
negative id) the request reached the GPU, where the embedding lookup or an
attention kernel hit a device-side assert and the engine died with every
request in flight. The input processor builds the request on the host, so
these tests run there, on a config-only model.
"""

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

VOCAB = 1000


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    ).save_pretrained(path)
    config = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=256,
    ).create_engine_config()
    return InputProcessor(config)


def _process(processor, ids):
    return processor.process_inputs(
        "req-0",
        tokens_input(ids),
        SamplingParams(max_tokens=4),
        supported_tasks=("generate",),
    )


@pytest.mark.parametrize(
    "ids, bad, pos",
    [([10, 20, 999999], 999999, 2), ([10, VOCAB], VOCAB, 1), ([-1, 3], -1, 0)],
)
def test_out_of_vocabulary_ids_are_refused_without_a_tokenizer(
    processor, ids, bad, pos
):
    assert processor.tokenizer is None
    with pytest.raises(VLLMValidationError) as refused:
        _process(processor, ids)
    message = str(refused.value)
    assert f"Token id {bad} at position {pos}" in message
    assert f"token ids 0 to {VOCAB - 1}" in message
    # A ValueError: the OpenAI server answers it with HTTP 400.
    assert isinstance(refused.value, ValueError)


def test_ids_inside_the_vocabulary_pass(processor):
    request = _process(processor, [0, 10, VOCAB - 1])
    assert request.prompt_token_ids == [0, 10, VOCAB - 1]
