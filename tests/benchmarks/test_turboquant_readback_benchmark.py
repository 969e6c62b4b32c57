# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The read-back microbenchmark (benchmarks/kernels/
benchmark_turboquant_readback.py) without a GPU: both read-backs it times,
run once each under the Triton interpreter, agree, and its report says so."""

import math
import subprocess
import sys

import pytest
import torch

from tests.benchmarks import (
    REPO,
    import_benchmark,
    import_kernel_helper,
    readme_command,
)


def _bench():
    return import_benchmark("benchmarks.kernels.benchmark_turboquant_readback")


PRESETS = import_kernel_helper("turboquant_layer_setup").PRESETS


class _OneCall:
    """The benchmark's timer, minus the timing: one call, a fixed reading."""

    host_us = 2.0

    def __call__(self, fn) -> float:
        fn()
        return 1.0


@pytest.mark.triton_interpret
def test_both_read_backs_run_with_every_flag_and_agree():
    bench = _bench()
    rows: list[dict] = []
    bench.bench(
        [("tiny", 4, 2, 64)],  # the smallest head_dim the split-KV decode serves
        [40],  # two pages and a half: the last program is masked
        PRESETS,
        _OneCall(),
        1e12,
        rows,
        lambda s: None,
        device="cpu",
        dtype=torch.float32,
    )
    assert [r["kv"] for r in rows] == [p.removeprefix("turboquant_") for p in PRESETS]
    for r in rows:
        # fp32 out: the passes round through fp16, the one launch does not.
        assert r["diff"] < 2e-3, r
        assert r["new_us"] == r["old_us"] == r["held_us"] == 1.0
    flags = {r["kv"]: r["flags"] for r in rows}
    assert flags["k8v4"] == []
    assert flags["4bit_nc"] == ["key_offset", "key_scale", "value_rotation"]
    md = bench.markdown(
        dict(time="t", device="cpu", torch="2", triton="3", vllm="v",
             copy_bandwidth_gbs=1000.0), rows,
    )  # fmt: skip
    assert "| tiny 2x64 | 40 | k8v4 | - |" in md
    assert md.count("| 1.00x |") == len(rows)


def test_floor_counts_the_slot_read_and_bf16_k_and_v_written():
    # Qwen3-4B, 8,192 cached tokens, 4bit_nc's 134-byte slot: 42.5 MB.
    assert _bench().readback_bytes(8192, 8, 128, 134) == 8192 * 8 * (134 + 512)


def test_the_documented_command_runs_from_the_repo_root_and_needs_a_gpu():
    command = readme_command(
        r"`python (benchmarks/kernels/benchmark_turboquant_readback\.py[^`]*)`"
    )
    out = subprocess.run(
        [sys.executable, *command.split()],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "needs a CUDA GPU" in out.stderr


@pytest.mark.triton_interpret
def test_a_value_row_the_one_launch_leaves_unwritten_shows_in_the_diff(monkeypatch):
    """Keys right, one value row left NaN: the diff is NaN, not the keys'."""
    bench = _bench()
    real = bench.read_back_in_one_launch

    def last_value_row_unwritten(
        impl, cache, row, cached, c, pit, k_out, v_out, ex, **held
    ):
        v_all = torch.empty_like(v_out)
        real(impl, cache, row, cached, c, pit, k_out, v_all, ex)
        v_out[: cached - 1] = v_all[: cached - 1]

    monkeypatch.setattr(bench, "read_back_in_one_launch", last_value_row_unwritten)
    rows: list[dict] = []
    bench.bench(
        [("tiny", 4, 2, 64)], [40], PRESETS[:1], _OneCall(), 1e12, rows,
        lambda s: None, device="cpu", dtype=torch.float32,
    )  # fmt: skip
    assert math.isnan(rows[0]["diff"])
