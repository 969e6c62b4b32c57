# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main model's cache config as a draft model's own VllmConfig reads it."""

from vllm.config import CacheConfig, ModelConfig
from vllm.config.utils import replace


def draft_cache_config(
    cache_config: CacheConfig,
    main_model_config: ModelConfig,
    draft_model_config: ModelConfig,
) -> CacheConfig:
    """``cache_config`` for the VllmConfig a draft model is built under.

    Without prefix caching, a hybrid main model's ``mamba_block_size``
    defaults to its ``max_model_len`` (one Mamba block per request), and
    VllmConfig takes a ``mamba_block_size`` that differs from its model's
    ``max_model_len`` for one the user set, which prefix caching must then
    be on for. The draft's VllmConfig pairs the main's cache config with the
    draft's model config, whose ``max_model_len`` is capped at the draft's
    own limit: a draft with a shorter context than the main made that check
    refuse the default. The draft's config gets the default as it applies to
    its own context; a value the user set, or prefix caching, is kept.
    """
    defaulted = (
        not cache_config.enable_prefix_caching
        and cache_config.mamba_block_size == main_model_config.max_model_len
    )
    if not defaulted or draft_model_config.max_model_len == (
        main_model_config.max_model_len
    ):
        return cache_config
    return replace(cache_config, mamba_block_size=draft_model_config.max_model_len)
