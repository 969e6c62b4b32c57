# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keep a speculative drafter's attention layers in one KV-cache group.

Hybrid models split each KV-cache spec type into groups of ``group_size``
layers (the smallest type's layer count, e.g. Qwen3-Coder-Next's 12 attention
layers). A dense draft model beside such a main (LocoOperator-4B: 36 layers)
is a type of its own and was split over three groups; the proposer builds one
attention metadata (one block table) for all its layers and stops with
``All drafting layers should belong to the same kv cache group``.

Growing the group size to the drafter type's layer count keeps them together
at the cost of padding the smaller types' groups; the upstream warning
"Add N padding layers" reports it and the capacity planner counts it, since
it calls the same code. A proposer that builds metadata per draft group would
avoid the padding; it is a larger change to the speculative path.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
    is_draft_layer,
)
from vllm.utils.math_utils import cdiv

logger = init_logger(__name__)


def _num_main_layers() -> int | None:
    config = get_current_vllm_config_or_none()
    if config is None or config.speculative_config is None:
        return None
    return config.model_config.hf_text_config.num_hidden_layers


def _drafters_split(layers: list[str], group_size: int, num_main: int | None) -> bool:
    # Upstream assigns layers[i::num_groups] to group i.
    num_groups = cdiv(len(layers), group_size)
    return (
        len(
            {
                i % num_groups
                for i, n in enumerate(layers)
                if is_draft_layer(n, num_main)
            }
        )
        > 1
    )


def group_size_keeping_drafters_together(
    layers_by_type: Iterable[list[str]], group_size: int
) -> int:
    """The smallest group size >= ``group_size`` under which no spec type's
    drafter layers are spread over two groups."""
    num_main = _num_main_layers()
    needed = group_size
    for layers in layers_by_type:
        while _drafters_split(layers, needed, num_main):
            needed += 1
    if needed == group_size:
        return group_size
    logger.info(
        "Keeping the drafter attention layers in one KV cache group: group size "
        "%d instead of %d (smaller layer types are padded).",
        needed,
        group_size,
    )
    return needed
