# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache matrix's cells of the trained checkpoints (``--trained``,
issue 47): every engine the GPU run starts has a configuration vLLM accepts,
on the converted SmolLM2-135M and Gemma-3-270M."""

import os

import pytest

from tests.models.real_weights import checkpoints as ck
from tests.models.real_weights.test_real_checkpoints import SKIP_ENV
from tests.models.tiny_hybrids import prefix_cache_matrix as pcm

pytestmark = pytest.mark.cpu_test


@pytest.fixture(scope="module")
def built():
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: real checkpoints not fetched")
    return {name: ck.build(name) for name in ("smollm2_135m", "gemma3_270m")}


def test_every_trained_engine_is_one_vllm_accepts(built):
    """PREFIX_CACHING.md's run: SmolLM2 within its 8,192 positions (2K and 7K
    prefixes), Gemma 3 at the matrix's max_model_len; prefix caching on in
    the cells and off in their cold references."""
    from vllm.engine.arg_utils import EngineArgs

    args = pcm.parse_args(
        ["out", "--no-plan", "--only", "smollm2,gemma3", "--prefix-lens", "2048,7168",
         "--trained", f"smollm2={built['smollm2_135m']}",
         "--trained", f"gemma3={built['gemma3_270m']}"]
    )  # fmt: skip
    engines = pcm.engine_plan(pcm.select(pcm.cells(tuple(args.trained)), args.only))
    assert len(engines) == 16
    for cell in engines:
        kw = pcm.engine_kwargs(cell, args.trained)
        config = EngineArgs(**kw).create_engine_config()
        assert config.cache_config.enable_prefix_caching is cell.prefix_caching
        assert config.cache_config.cache_dtype == cell.kv
        limit = 8192 if cell.model == "smollm2" else pcm.MAX_MODEL_LEN
        assert config.model_config.max_model_len == limit
