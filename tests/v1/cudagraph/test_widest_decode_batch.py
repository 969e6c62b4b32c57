# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A uniform decode batch of every running sequence replays a FULL CUDA graph
when ``max_num_seqs`` (times the decode query length) is off vLLM's capture
grid of 8- and 16-token steps."""

from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    SchedulerConfig,
    VllmConfig,
)
from vllm.platforms import current_platform
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher


def _config(max_num_seqs: int, num_speculative_tokens: int = 0, **compilation):
    with patch.object(current_platform, "device_count", return_value=1):
        config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=8192,
                max_model_len=2048,
                is_encoder_decoder=False,
            ),
        )
        config.model_config = MagicMock(
            dtype=torch.float16,
            enforce_eager=False,
            is_moe=False,
            disable_cascade_attn=False,
            get_hidden_size=MagicMock(return_value=4096),
        )
        if num_speculative_tokens:
            config.speculative_config = MagicMock(
                num_speculative_tokens=num_speculative_tokens
            )
        config.compilation_config = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE,
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
            **compilation,
        )
        config.compilation_config.set_splitting_ops_for_v1(
            all2all_backend=config.parallel_config.all2all_backend,
            data_parallel_size=1,
        )
        config._set_cudagraph_sizes()
    return config


def _dispatch(config, num_reqs: int, query_len: int = 1):
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(
        CUDAGraphMode.FULL_AND_PIECEWISE, uniform_decode_query_len=query_len
    )
    return dispatcher.dispatch(num_reqs * query_len, uniform_decode=True)


@pytest.mark.parametrize("max_num_seqs", [500, 100, 12])
def test_every_running_sequence_decodes_in_a_full_graph(max_num_seqs):
    """500 sequences: the grid's 496 is the largest FULL decode size vLLM
    0.20.2 keeps (at most ``max_num_seqs`` rows), so a step decoding all 500
    ran its attention outside a graph; 100 and 12 the same above 96 and 8."""
    config = _config(max_num_seqs)
    assert max_num_seqs in config.compilation_config.cudagraph_capture_sizes
    mode, batch = _dispatch(config, max_num_seqs)
    assert mode == CUDAGraphMode.FULL
    assert (batch.num_tokens, batch.num_reqs, batch.uniform) == (
        max_num_seqs,
        max_num_seqs,
        True,
    )
    # The rows between the grid's last size and it pad to it.
    mode, batch = _dispatch(config, max_num_seqs - 1)
    assert (mode, batch.num_tokens) == (CUDAGraphMode.FULL, max_num_seqs)


def test_verify_rows_of_every_sequence_decode_in_a_full_graph():
    """With one speculative token a decode step of 30 sequences is 60 tokens,
    off the grid (56, 64): captured too."""
    config = _config(30, num_speculative_tokens=1)
    assert 60 in config.compilation_config.cudagraph_capture_sizes
    mode, batch = _dispatch(config, 30, query_len=2)
    assert (mode, batch.num_tokens, batch.num_reqs) == (CUDAGraphMode.FULL, 60, 30)


@pytest.mark.parametrize(
    "max_num_seqs, compilation",
    [
        (256, {}),  # on the grid: nothing added
        (500, {"cudagraph_capture_sizes": [1, 2, 4, 8]}),  # the user's list
        (500, {"max_cudagraph_capture_size": 256}),  # above the user's cap
    ],
)
def test_sizes_on_the_grid_or_set_by_the_user_stay_as_they_are(
    max_num_seqs, compilation
):
    config = _config(max_num_seqs, **compilation)
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert 500 not in sizes
    assert all(s in (1, 2, 4) or s % 8 == 0 for s in sizes)
