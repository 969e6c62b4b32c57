# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/quality/raw_window_pages.py: what a recent raw window built as a
sliding-window twin per TurboQuant layer costs in bits, from vLLM's own page
unification (FINDINGS-3bit.md quotes its table)."""

import pytest

from tests.benchmarks import import_benchmark


@pytest.fixture
def pages():
    return import_benchmark("benchmarks.quality.raw_window_pages")


def test_the_twin_costs_its_blocks_not_its_window(pages, capsys):
    """SmolLM2's attention with an 8-token twin: vLLM unifies the pages at
    304-token TurboQuant blocks and 64-token twin blocks, two of which a
    request holds per layer; the preset alone is 3.375 bits at any context,
    and the window's share falls with the context."""
    assert pages.main([]) == 0
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "layout" not in line
    }
    assert rows["turboquant_3bit_nc alone"][-3:] == ["3.375", "3.375", "3.375 |"]
    assert rows["vLLM"][:3] == ["304", "64", "49,248"]
    assert rows["smallest twin block"][:3] == ["80", "16", "12,960"]
    vllm_bits = [float(b.strip(" |")) for b in rows["vLLM"][-3:]]
    assert vllm_bits == sorted(vllm_bits, reverse=True)
    assert vllm_bits[-1] > 3.375


def test_a_twin_as_wide_as_its_window_costs_the_same(pages):
    """Windows of 8 and 16 tokens hold the same two twin blocks: the same
    bits."""
    assert pages.markdown(30, 3, 64, "turboquant_3bit_nc", 8, [8192]).replace(
        "8-token", "W"
    ) == pages.markdown(30, 3, 64, "turboquant_3bit_nc", 16, [8192]).replace(
        "16-token", "W"
    )


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--window", "0"], "--window 0: expected at least 1"),
        (["--contexts", "0"], "--contexts 0: expected at least 1"),
        (["--preset", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_bad_arguments_are_named(pages, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        pages.main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
