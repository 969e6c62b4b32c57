# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: tiny Qwen3.5-like and Qwen3-Next-like checkpoints generate with every
TurboQuant preset, with and without an MTP layer, and with padded pages
(patches 0004/0005), and their outputs match references that can differ:
transformers' fp32 greedy decode (auto), the same preset without speculation
(MTP, draft model), auto (TurboQuant presets, AGREE_MIN). See
turboquant_matrix.py for what each row is compared against.

On pristine 0.20.2 every TurboQuant case stops at config time with
"TurboQuant KV cache is not supported for hybrid (attention + Mamba) models".
All engines run once, in parallel (``turboquant_matrix.run_matrix``); each
test reads its row.
"""

import pytest

from . import turboquant_matrix as tqm

CONFIGS = tqm.configs()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    result = tqm.run_matrix(CONFIGS, jobs=12, workdir=tmp_path_factory.mktemp("tqm"))
    print(tqm.format_rows(result))
    return {r["name"]: r for r in result}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_tiny_hybrid_turboquant_matches_reference(rows, cfg):
    row = rows[cfg.name]
    assert row["ok"], f"vs {row['against']}: {row['why']}\n{row.get('log_tail', '')}"
    if cfg.skip or cfg.spec == "draft":
        assert any("KV cache pages unified" in line for line in row["planner_lines"])
