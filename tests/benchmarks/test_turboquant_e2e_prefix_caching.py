# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The e2e harness's shared-prefix workload and its prefix caching on/off
configurations (issue 47): what the engine is asked for, what the prompts
share, and the ratio of caching on over off. No engine is started."""

import random

import pytest

from tests.benchmarks import import_benchmark, readme_command


@pytest.fixture(scope="module")
def e2e():
    return import_benchmark("benchmarks.e2e.benchmark_turboquant_e2e")


def test_a_suffix_turns_prefix_caching_on_or_off(e2e):
    assert e2e.kv_config("auto") == ("auto", None)
    assert e2e.kv_config("auto+pc") == ("auto", True)
    assert e2e.kv_config("turboquant_4bit_nc+nopc") == ("turboquant_4bit_nc", False)
    assert "turboquant_k3v4_nc+pc" in e2e.KV_CONFIGS


def test_shared_prefix_prompts_share_exactly_their_prefix(e2e):
    pytest.importorskip("vllm.inputs")
    n, length, _ = e2e.SCENARIOS["shared-prefix"]
    shared = e2e.SHARED_PREFIX["shared-prefix"]
    prompts = e2e.prompt_maker(random.Random(0), 1000)
    batch = [p["prompt_token_ids"] for p in prompts(n, length, shared)]
    assert len(batch) == n and all(len(t) == length for t in batch)
    assert all(t[:shared] == batch[0][:shared] for t in batch)
    assert len({tuple(t[shared:]) for t in batch}) == n
    # The next repeat starts cold: a prefix of its own.
    again = prompts(n, length, shared)[0]["prompt_token_ids"]
    assert again[:shared] != batch[0][:shared]
    # Other scenarios share nothing.
    assert len({tuple(p["prompt_token_ids"][:8]) for p in prompts(8, 64)}) == 8


def _row(kv, tok_s, ttft):
    return dict(
        model="Qwen3.6-27B",
        kv=kv,
        rc=0,
        scenarios={
            "shared-prefix": dict(
                output_tok_s=tok_s,
                ttft_median_s=ttft,
                ttft_p90_s=ttft,
                prefill_median_s=ttft / 2,
                tpot_median_s=0.01,
                tpot_p90_s=0.01,
                output_tok_s_spread=0.0,
                ttft_median_s_spread=0.0,
            )
        },
    )


def test_caching_on_is_compared_with_off_and_with_auto_alike(e2e):
    rows = [
        _row("auto+nopc", 100.0, 4.0),
        _row("auto+pc", 300.0, 1.0),
        _row("turboquant_4bit_nc+nopc", 110.0, 4.4),
        _row("turboquant_4bit_nc+pc", 330.0, 1.1),
    ]
    e2e.add_ratios(rows)
    on = rows[3]["scenarios"]["shared-prefix"]
    assert on["output_tok_s_vs_pc_off"] == pytest.approx(3.0)
    assert on["ttft_median_s_vs_pc_off"] == pytest.approx(0.25)
    # Against auto with the same prefix caching.
    assert on["output_tok_s_vs_auto"] == pytest.approx(1.1)
    assert "output_tok_s_vs_pc_off" not in rows[2]["scenarios"]["shared-prefix"]
    meta = dict(time="t", device="d", vllm="v", torch="t", repeats=1)
    md = e2e.markdown(meta, rows)
    assert "## Prefix caching on over off" in md
    assert "| Qwen3.6-27B | turboquant_4bit_nc | shared-prefix | 3.00x | 0.25x |" in md


def test_readme_command_runs_each_kv_dtype_with_caching_off_and_on(
    e2e, monkeypatch, capsys, tmp_path
):
    """benchmarks/README.md's prefix-caching command, as written: both shapes,
    four configurations each (no extra plain auto), the shared-prefix
    scenario, and the table of caching on over off."""
    import sys

    specs = []

    def run_config(model, kv, scenarios, args, profile=False):
        specs.append((model, kv, tuple(scenarios), args.repeats))
        on = e2e.kv_config(kv)[1]
        row = _row(kv, 300.0 if on else 100.0, 1.0 if on else 4.0)
        return {**row, "model": model, "kv_tokens": 1000, "wall_s": 1.0}

    monkeypatch.setattr(e2e, "run_config", run_config)
    command = readme_command(
        r"`python (benchmarks/e2e/\S+ [^`]*--scenarios shared-prefix[^`]*)`"
    )
    monkeypatch.setattr(sys, "argv", [*command.split(), "--out", str(tmp_path)])
    e2e.main()
    labels = [
        "auto+nopc",
        "auto+pc",
        "turboquant_4bit_nc+nopc",
        "turboquant_4bit_nc+pc",
    ]
    assert [(m, kv) for m, kv, _, _ in specs] == [
        (m, kv) for m in ("Qwen3-4B", "Qwen3.6-27B") for kv in labels
    ]
    assert {(s[2], s[3]) for s in specs} == {(("shared-prefix",), 3)}
    md = capsys.readouterr().out
    assert "| Qwen3.6-27B | auto | shared-prefix | 3.00x | 0.25x | 0.25x |" in md
