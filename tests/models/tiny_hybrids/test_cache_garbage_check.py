# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What cache_garbage_check counts as agreement between runs (CPU), and its
Gemma run (GPU)."""

import pytest

from .cache_garbage_check import verdict


def _run(fill, tokens, sums):
    return {"fill": fill, "tokens": tokens, "prompt_logprob_sums": sums}


def test_runs_that_agree_pass():
    runs = [_run(0x00, [[1, 2]], [-10.0]), _run(0xFF, [[1, 2]], [-10.0 + 1e-6])]
    assert verdict(runs) == (True, "every fill agrees")


def test_a_nan_or_a_changed_token_or_log_probability_fails():
    first = _run(0x00, [[1, 2], [3]], [-10.0, -5.0])
    ok, why = verdict([first, _run(0xFF, [[1, 2], [3]], [float("nan"), -5.0])])
    assert not ok and "0xFF" in why
    ok, why = verdict([first, _run(0x7F, [[1, 9], [3]], [-10.0, -5.0])])
    assert not ok and "tokens DIFFER" in why
    ok, why = verdict([first, _run(0x00, [[1, 2], [3]], [-10.0, -5.3])])
    assert not ok and "tokens same" in why


@pytest.mark.gpu
def test_gemma_with_turboquant_gives_the_same_numbers_first_and_later(tmp_path):
    from .cache_garbage_check import main

    # Gemma 3's bf16 sliding layers beside TurboQuant full-attention layers:
    # groups that share KV-cache buffers with two layouts.
    assert main([str(tmp_path), "--only", "gemma3_text", "--timeout", "220"]) == 0, (
        tmp_path / "garbage.json"
    ).read_text()
