# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""combine_turboquant_e2e.py: one end-to-end table from several harness runs
(device calls or sessions), each ratio kept against its own run's auto."""

import json

import pytest

from tests.benchmarks import import_benchmark, readme_command


@pytest.fixture(scope="module")
def combine():
    return import_benchmark("benchmarks.e2e.combine_turboquant_e2e")


def _row(model, kv, scenarios, tok):
    scen = {
        n: dict(repeats=3, output_tok_s=tok, output_tok_s_spread=0.01,
                ttft_median_s=0.1, ttft_p90_s=0.1, prefill_median_s=0.1,
                tpot_median_s=0.01, tpot_p90_s=0.01)
        for n in scenarios
    }  # fmt: skip
    return dict(model=model, kv=kv, rc=0, wall_s=1.0, kv_tokens=1000,
                device="NVIDIA H200", scenarios=scen)  # fmt: skip


def _run(path, rows, scenarios, **meta):
    base = dict(time="2026-12-01 12:00 UTC", device="NVIDIA H200",
                vllm="0.20.2+hybridkv.64", torch="2.11.0", repeats=3,
                max_num_seqs=None, tq_decode="default", queue="full",
                interleave=False,
                scenarios={n: [32, 64, 1024] for n in scenarios})  # fmt: skip
    path.write_text(json.dumps(dict(meta={**base, **meta}, rows=rows)))
    return path


def _two_runs(tmp_path):
    """Run 1 measures k8v4 on decode-heavy at 100 tok/s for auto, run 2
    4bit_nc on long-ctx-1 at 200 for auto (a faster host that day): each
    preset at 1.1x its own run's auto, so a ratio across runs reads 0.55x or
    2.2x."""
    a = _run(tmp_path / "RUN1.json", [
        _row("Qwen3-4B", "auto", ["decode-heavy"], 100.0),
        _row("Qwen3-4B", "turboquant_k8v4", ["decode-heavy"], 110.0),
    ], ["decode-heavy"])  # fmt: skip
    b = _run(tmp_path / "RUN2.json", [
        _row("Qwen3-4B", "auto", ["long-ctx-1"], 200.0),
        _row("Qwen3-4B", "turboquant_4bit_nc", ["long-ctx-1"], 220.0),
    ], ["long-ctx-1"], time="2026-12-02 09:00 UTC")  # fmt: skip
    return a, b


def test_readme_command_keeps_each_ratio_against_its_own_runs_auto(
    combine, monkeypatch, capsys, tmp_path
):
    """benchmarks/README.md's command, as written, on two runs whose auto
    differ 2x: every ratio is 1.10x. Fails where rows of two runs are keyed
    by model alone (the last run's auto then stands for both)."""
    command = readme_command(
        r"`python (benchmarks/e2e/combine_turboquant_e2e\S* [^`]*)`"
    )
    _two_runs(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert combine.main([*command.split()[1:], "--out", str(out)]) == 0

    (json_file,) = out.glob("e2e-combined-*.json")
    result = json.loads(json_file.read_text())
    ratios = {
        (r["kv"], r["run"]): s["output_tok_s_vs_auto"]
        for r in result["rows"]
        for s in r["scenarios"].values()
    }
    assert ratios == pytest.approx(
        {
            ("auto", 1): 1.0,
            ("turboquant_k8v4", 1): 1.1,
            ("auto", 2): 1.0,
            ("turboquant_4bit_nc", 2): 1.1,
        }  # fmt: skip
    )
    assert [r["run"] for r in result["meta"]["runs"]] == [1, 2]
    assert not list(out.glob("*.tmp"))
    md = capsys.readouterr().out
    assert "ratios are to the `auto` of the same run" in md
    row = "| Qwen3-4B (run 2) | turboquant_4bit_nc | 1,000 (1.00x) | long-ctx-1 |"
    assert f"{row} 220 (1.10x) |" in md
    # What the full table still lacks, per model and KV dtype.
    assert "- Qwen3-4B turboquant_k8v4: short-decode, long-prefill," in md
    assert "- Qwen3.6-27B auto: short-decode," in md
    assert (
        "decode-heavy" not in md.split("- Qwen3-4B turboquant_k8v4: ")[1].split("\n")[0]
    )


def _meta(**kw):
    def spoil(run):
        run["meta"].update(kw)

    return spoil


def _without_auto(run):
    run["rows"] = run["rows"][1:]


def _k8v4_decode_heavy_again(run):
    run["rows"] = [
        _row("Qwen3-4B", "auto", ["decode-heavy", "long-ctx-1"], 200.0),
        _row("Qwen3-4B", "turboquant_k8v4", ["decode-heavy"], 220.0),
    ]


@pytest.mark.parametrize(
    "spoil, says",
    [
        (_meta(device="NVIDIA H100"), "GPU model is 'NVIDIA H100'"),
        (_meta(vllm="0.20.2+hybridkv.65"), "vLLM version is '0.20.2+hybridkv.65'"),
        (_meta(repeats=1), "timed repeats per scenario (--repeats) is 1"),
        (_meta(scenarios={"decode-heavy": [32, 64, 512]}),
         "scenario decode-heavy is [32, 64, 512]"),
        (_without_auto, "long-ctx-1 has no auto of its own run"),
        (_k8v4_decode_heavy_again,
         "Qwen3-4B turboquant_k8v4 decode-heavy was measured in"),
        (None, "not a result file of benchmark_turboquant_e2e.py"),
    ],
)  # fmt: skip
def test_runs_that_do_not_make_one_table_are_refused_by_name(
    combine, capsys, tmp_path, spoil, says
):
    """Exit 2 and one line naming the second file, the rule and the fix;
    nothing written."""
    first, second = _two_runs(tmp_path)
    if spoil is None:
        second.write_text("{}")
    else:
        run = json.loads(second.read_text())
        spoil(run)
        second.write_text(json.dumps(run))
    out = tmp_path / "out"
    assert combine.main([str(first), str(second), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"combine_turboquant_e2e: {second}: "), err
    assert says in err
    assert not out.exists()
