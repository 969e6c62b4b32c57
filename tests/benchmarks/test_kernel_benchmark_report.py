# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernel microbenchmark (benchmarks/kernels/
benchmark_turboquant_decode.py) without a GPU: its command, and its report
from rows of every kind."""

import subprocess
import sys

import pytest

from tests.benchmarks import REPO, import_benchmark, refused


def _bench():
    return import_benchmark("benchmarks.kernels.benchmark_turboquant_decode")


META = dict(
    time="2026-11-23 14:31 UTC",
    device="NVIDIA H100 80GB HBM3",
    torch="2.11.0+cu130",
    triton="3.6.0",
    vllm="0.20.2+hybridkv.9",
)
BW = 3.0e12
CASE = dict(case="Qwen3-4B", heads="32/8x128", batch=16, context=8192)


def test_report_names_the_stage1_its_host_time_and_the_split_points():
    rows = [
        dict(CASE, kind="decode", kv="bf16 (FA)", bytes=8.4e8, fa_us=200.0),
        dict(
            CASE,
            kind="decode",
            kv="k8v4",
            bytes=2.055e8,
            floor_us=68.5,
            old_us=707.2,
            new_us=206.6,
            new_host_us=315.0,
            stage1="gluon",
            fa_us=199.6,
            fa_host_us=30.0,
            rel_diff_new_old=3.1e-3,
            old_err=1.8e-3,
            new_err=1.8e-3,
        ),
        # A kernel that failed: no times, no stage 1.
        dict(CASE, kind="decode", kv="4bit_nc", bytes=1.4e8, floor_us=46.8),
        # As the backend calls it: key offset and rotated values (0027, 0028).
        dict(
            CASE,
            kind="decode",
            kv="3bit_nc",
            bytes=1.2e8,
            floor_us=40.0,
            new_us=120.0,
            served_us=126.0,
        ),
        dict(
            CASE,
            kind="splits",
            kv="k8v4",
            splits=128,
            maxnreg=168,
            stage1="gluon",
            bytes=2.055e8,
            new_us=150.0,
            new_err=2.0e-3,
        ),
        dict(
            CASE,
            kind="splits",
            kv="k8v4",
            splits="default",
            stage1="gluon",
            bytes=2.055e8,
            new_us=float("nan"),
            new_err=float("nan"),
        ),
    ]
    md = _bench().markdown(META, rows, BW)
    lines = md.splitlines()
    decode = next(line for line in lines if "| k8v4 |" in line and "68.5" in line)
    assert "| 206.6 (33%) | gluon | 315.0 | 10.5x | 0.97x |" in decode
    failed = next(line for line in lines if "| 4bit_nc |" in line)
    assert "| n/a (n/a) | n/a | n/a | n/a |" in failed
    assert (
        "| Qwen3-4B 32/8x128 | 16 x 8192 | 3bit_nc | 120.0 | 126.0 | 1.050x | 32% |"
        in md
    )
    assert "## Default stage 1 at other split counts" in md
    assert (
        "| Qwen3-4B 16 x 8192 | k8v4 | 128 | gluon | 168 | 150.0 | 46% | 2.0e-03 |"
        in md
    )
    # A NaN error (poisoned output left in place) is flagged, not hidden.
    assert "| default | gluon | - |" in md and "nan FAIL |" in md


def _run(*args, script="benchmark_turboquant_decode.py"):
    return subprocess.run(
        [sys.executable, f"benchmarks/kernels/{script}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--quick"],
        ["--sweep"],
        [
            "--raw-window",
            "16",
            "--no-store",
            "--presets",
            "turboquant_k8v4",
            "turboquant_4bit_nc",
            "turboquant_3bit_nc",
        ],
        [
            "--splits",
            "--no-store",
            "--presets",
            "turboquant_k8v4",
            "turboquant_4bit_nc",
        ],
    ],
)
def test_the_documented_commands_run_from_the_repo_root_and_need_a_gpu(args):
    # benchmarks/README.md's commands, as files from the repo root: each
    # imports the kernel tests' reference from this checkout, then asks for a
    # GPU.
    out = _run(*args)
    assert out.returncode == 1
    assert "needs a CUDA GPU" in out.stderr


def test_an_unknown_preset_is_named_before_anything_runs():
    status, err = refused(
        "benchmark_turboquant_decode.py", ["--presets", "turboquant_5bit"]
    )
    assert status == 2
    assert "invalid choice: 'turboquant_5bit'" in err
    assert "turboquant_k8v4" in err  # the valid ones


@pytest.mark.parametrize(
    "script",
    [
        "benchmark_turboquant_decode.py",
        "benchmark_turboquant_store.py",
        "benchmark_turboquant_readback.py",
    ],
)
@pytest.mark.parametrize(
    "args, named",
    [
        (["--iters", "0"], "--iters 0: expected at least 1"),
        (["--presets", "turboquant_5bit"], "invalid choice: 'turboquant_5bit'"),
        # Not an empty run: a table of no presets.
        (["--presets"], "--presets: expected at least one argument"),
    ],
)
def test_bad_arguments_are_named_before_anything_runs(script, args, named):
    status, err = refused(script, args)
    assert status == 2, err[-2000:]
    assert named in err


@pytest.mark.parametrize(
    "size, named", [("65", "--raw-window 65: a window is 1 to 64 tokens"),
                    ("-1", "--raw-window -1: a window is 1 to 64 tokens")]
)  # fmt: skip
def test_a_raw_window_the_engine_would_refuse_is_refused_first(size, named):
    status, err = refused("benchmark_turboquant_decode.py", ["--raw-window", size])
    assert status == 2, err[-2000:]
    assert named in err and "recent:W" in err


def test_report_puts_the_window_against_the_decode_as_served():
    """Rotated 3-bit values: against the served decode; k8v4, which takes no
    extras, against the plain one; a failed window run leaves no row."""
    rows = [
        dict(CASE, kind="decode", kv="3bit_nc", bytes=1.2e8, floor_us=40.0,
             new_us=120.0, served_us=126.0, window_us=129.78, window_host_us=260.0,
             window_base_us=126.0, window_base_host_us=200.0),
        dict(CASE, kind="decode", kv="k8v4", bytes=2.0e8, floor_us=66.0,
             new_us=100.0, window_us=104.0, window_base_us=100.0),
        dict(CASE, kind="decode", kv="4bit_nc", bytes=1.4e8, floor_us=46.8,
             new_us=110.0, window_us=None, window_base_us=110.0),
    ]  # fmt: skip
    md = _bench().markdown(dict(META, raw_window=16), rows, BW)
    assert "with a raw window of 16 tokens" in md
    assert (
        "| Qwen3-4B 32/8x128 | 16 x 8192 | 3bit_nc | 126.0 | 129.8 | 1.030x | "
        "200.0 | 260.0 |" in md
    )
    assert "| k8v4 | 100.0 | 104.0 | 1.040x | n/a | n/a |" in md
    assert "| 4bit_nc | 110.0 |" not in md
    assert "with a raw window 129.8 (1.030x)" in _bench().fmt_row(rows[0], BW)


@pytest.mark.parametrize("size, context", [(16, 8192), (16, 640), (64, 1000), (1, 17)])
def test_the_benchmarks_window_reads_pages_of_its_own_row(size, context):
    """Every row's last ``size`` positions sit on distinct twin pages that no
    other row's window reads: the window the GPU times reads real data."""
    bench = _bench()
    window = bench.raw_window_of(3, context, 2, 64, size, device="cpu")
    assert window.size == size and window.key_cache.dtype.is_floating_point
    seen = {}
    for row in range(3):
        pos = range(context - size, context)
        pages = {window.block_table[row, p // bench.PAGE].item() for p in pos}
        assert len(pages) == len({p // bench.PAGE for p in pos})
        for page in pages:
            assert seen.setdefault(page, row) == row, f"page {page} shared"
            assert 0 <= page < window.key_cache.shape[0]


def test_the_store_table_puts_the_store_as_served_against_bf16():
    # The backend stores 3- and 4-bit MSE keys with a key offset and rotated
    # values (0027, 0028): the store it runs, not only the plain call, is
    # what the store target (<= 1.0x bf16) is read from.
    store = dict(kind="store", case="Qwen3-4B", heads="32/8x128", tokens=64)
    rows = [
        dict(store, kv="bf16", bytes=1.0e6, old_us=5.0),
        dict(store, kv="4bit_nc", bytes=6.6e5, new_us=5.5, served_us=4.5,
             old_us=30.0, bf16_us=5.0),
        dict(store, kv="k8v4", bytes=7.2e5, new_us=4.9, served_us=4.9,
             old_us=6.0, bf16_us=5.0),
    ]  # fmt: skip
    md = _bench().markdown(META, rows, BW)
    assert "| shipped µs | shipped / bf16 | as served µs | as served / bf16 |" in md
    assert "| 64 | 4bit_nc | 5.5 | 1.10x | 4.5 | 0.90x | 30.0 | 5.0 |" in md
    assert "| 64 | k8v4 | 4.9 | 0.98x | 4.9 | 0.98x | 6.0 | 5.0 |" in md


def test_mse_presets_are_timed_with_the_backends_query_rotation(monkeypatch):
    # The backend's decode (maybe_decode_attention) rotates the query in one
    # small kernel: its matrix is the backend's own Hadamard object. The
    # benchmark called decode_attention with an equal matrix of its own and
    # timed 0.20.2's fp32 GEMM and a copy instead, 11-16 us of every MSE
    # reading at 16 x 8K on an H100.
    import torch

    from vllm.v1.attention.ops import turboquant_decode as tq_decode

    calls = []
    monkeypatch.setattr(tq_decode, "decode_attention", lambda *a, **k: calls.append(k))
    bench = _bench()
    for preset, hadamard in (("turboquant_4bit_nc", True), ("turboquant_k8v4", False)):
        cfg = bench.tq_config(preset, 128)
        _, _, pit = bench.tq_tables(cfg, 128, device="cpu")
        query = torch.zeros(1, 4, 128)
        bench.splitkv_call(query, None, None, None, cfg, None, pit, 1.0)()
        assert calls.pop()["hadamard_query"] is hadamard, preset


def test_the_stage1_probe_does_not_read_a_replayed_plan_as_triton(monkeypatch):
    # A call with a remembered launch plan replays its launches without
    # calling the Gluon module's stage1: probed after the timed calls, every
    # stage 1 read "triton" (release 68's H200 run, Gluon stage 1s all).
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon
    from vllm.v1.attention.ops import turboquant_decode as tq_decode

    bench = _bench()
    monkeypatch.setattr(tq_decode, "_plans", {"a call seen before": object()})
    monkeypatch.setattr(gluon, "stage1", lambda *a, **k: None)

    def call():  # decode_attention's order: a remembered plan, else a launch
        if not tq_decode._plans:
            gluon.stage1()

    assert bench.stage1_of(call) == "gluon"
    assert tq_decode._plans  # left as they were


def test_the_pair_preset_is_timed_on_its_own_codebook_without_0202_kernels():
    """turboquant_3bit_pair_nc (patch 0034): its layer's 64 points are the
    centroids, and the store reads them with their search cells; 0.20.2's
    decode, which reads levels, is not timed beside it."""
    import torch

    bench = _bench()
    cfg = bench.tq_config("turboquant_3bit_pair_nc", 128)
    points, store_table, _ = bench.tq_tables(cfg, 128, device="cpu")
    assert points.shape == (64, 2) and torch.equal(store_table[:64], points)
    assert store_table.shape[0] > 64  # the search cells (pair_search_table)
    q = torch.zeros(1, 4, 128)
    assert (
        bench.tq_decode_runner(q, None, None, None, cfg, points, None, 1.0, False)
        is None
    )
    levels, mids, _ = bench.tq_tables(
        bench.tq_config("turboquant_3bit_nc", 128), 128, device="cpu"
    )
    assert levels.shape == (8,) and mids.shape == (7,)
