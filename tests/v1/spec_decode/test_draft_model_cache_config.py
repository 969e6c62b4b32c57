# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A draft model with a shorter context than its hybrid main model builds.

Without prefix caching, vLLM 0.20.2 sets a hybrid main model's
``mamba_block_size`` to its ``max_model_len``; the draft-model proposer then
builds the draft's VllmConfig from the main's cache config and the draft's
model config, whose ``max_model_len`` is capped at the draft's own limit, and
its validator took the default for a value set without prefix caching:
"--mamba-block-size can only be set with --enable-prefix-caching", raised on
every worker while it loads the draft, after the engine config was accepted
(Qwen3-Coder-Next beside a 40,960-token draft at any longer context).
"""

import pytest

from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.draft_model import DraftModelProposer


def _configs(tmp_path, **kwargs):
    main = write_full_size_config("Qwen3-Coder-Next-80B-A3B", tmp_path / "main")
    draft = write_full_size_config("LocoOperator-4B", tmp_path / "draft")
    config = EngineArgs(
        model=str(main),
        load_format="dummy",
        skip_tokenizer_init=True,
        speculative_config={
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 3,
        },
        **kwargs,
    ).create_engine_config()
    proposer = object.__new__(DraftModelProposer)
    proposer.vllm_config = config
    proposer.speculative_config = config.speculative_config
    return config, proposer


def test_a_shorter_draft_builds_beside_a_hybrid_main(tmp_path):
    config, proposer = _configs(tmp_path, max_model_len=65536)
    draft_len = config.speculative_config.draft_model_config.max_model_len
    assert draft_len == 40960 < config.model_config.max_model_len
    assert config.cache_config.mamba_block_size == 65536  # the main's default

    draft_config = proposer._create_draft_vllm_config()

    assert draft_config.model_config.max_model_len == draft_len
    assert draft_config.cache_config.mamba_block_size == draft_len
    # The main model's own config is left as it was.
    assert config.cache_config.mamba_block_size == 65536


def test_prefix_caching_keeps_the_mamba_block_size(tmp_path):
    config, proposer = _configs(
        tmp_path, max_model_len=65536, enable_prefix_caching=True
    )
    draft_config = proposer._create_draft_vllm_config()
    assert draft_config.cache_config.mamba_block_size == (
        config.cache_config.mamba_block_size
    )
    assert draft_config.cache_config.mamba_block_size != 65536


@pytest.mark.parametrize("max_model_len", [40960, 4096])
def test_a_context_the_draft_holds_keeps_the_main_cache_config(tmp_path, max_model_len):
    config, proposer = _configs(tmp_path, max_model_len=max_model_len)
    draft_config = proposer._create_draft_vllm_config()
    assert draft_config.cache_config is config.cache_config
