# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/README.md's GPU-less command: the decode kernels' sm_90 compile
report, for the Triton stage 1 and (``--gluon``) the Gluon one."""

import os
import re
import subprocess
import sys

import pytest

from tests.benchmarks import REPO, import_benchmark, refused

REPORT = REPO / "benchmarks/kernels/compile_report_turboquant_decode.py"


@pytest.mark.parametrize("extra", [[], ["--gluon"], ["--gluon", "--sass"]])
def test_compile_report_prints_a_row_per_case(extra):
    pytest.importorskip("triton.experimental.gluon")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, str(REPORT), "--presets", "turboquant_k8v4",
         "--head-dims", "128", *extra],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("turboquant")]
    assert len(rows) == 1, out.stdout
    # A case that fails to compile prints its name, a colon and the error.
    assert ":" not in rows[0], rows[0]
    fields = rows[0].split()
    if extra:  # preset, head_dim, registers, spill bytes, shared, programs/SM,
        # loop instructions per token: PTX, SASS
        assert int(fields[2]) <= 255 and int(fields[3]) == 0, rows[0]
        assert 0 < int(fields[7]) <= int(fields[6]) * 2, rows[0]
        registers, warps, per_sm = int(fields[2]), 1, int(fields[5])
    else:  # ..., registers, spill bytes, shared, programs/SM, loop per token
        assert int(fields[-5]) <= 255 and int(fields[-1]) > 0, rows[0]
        warps = int(re.search(r"\(\d+, (\d+)", rows[0]).group(1))  # geometry
        registers, per_sm = int(fields[-5]), int(fields[-2])
    # Registers are allocated 8 per thread at a time, from each of an SM's 4
    # schedulers' 16,384 (ncu's block limit for 226 registers and one warp: 8
    # programs); the shared memory is far from binding at head_dim 128.
    allocated = -(-registers // 8) * 8
    assert per_sm == 4 * (16384 // (allocated * 32)) // warps, rows[0]
    mix = [line for line in out.stdout.splitlines() if "SASS per warp" in line]
    if "--sass" in extra:
        # The tile loop reloads the query chunks with ldmatrix and runs the
        # dots on tensor cores.
        assert len(mix) == 1 and "LDSM" in mix[0] and "HMMA" in mix[0], out.stdout
    else:
        assert not mix, out.stdout


def test_sass_needs_the_gluon_report():
    status, err = refused(REPORT.name, ["--sass"])
    assert status == 2
    assert "--sass reports the Gluon stage 1: add --gluon" in err


def test_compile_report_names_a_head_dim_it_has_no_case_for():
    status, err = refused(REPORT.name, ["--head-dims", "100"])
    assert status == 2
    assert "--head-dims: invalid choice: 100 (choose from 64, 128, 256, 512)" in err


@pytest.mark.parametrize("geometry", ["32,x", "32", "32,4,64,168,1", "32,0"])
def test_compile_report_names_a_geometry_it_cannot_read(geometry):
    status, err = refused(REPORT.name, ["--geometries", geometry])
    assert status == 2, err[-2000:]
    assert f"--geometries: invalid geometry '{geometry}'" in err
    assert "BLOCK_N,warps[,key_chunk[,maxnreg]]" in err


def test_gluon_stage1_keeps_the_warps_its_split_count_assumes():
    """The Gluon stage 1's split counts assume ``resident_warps()`` per SM,
    from its register cap. Every preset and head_dim must compile within
    it, with spills too small to matter (ptxas for sm_90 from Triton 3.6
    spilled 0-14 bytes): splits sized for programs that cannot be resident
    run in waves the count does not model, and large spills would cost more
    than the warps gain. A new Triton or a kernel change that outgrows the
    cap turns this red."""
    pytest.importorskip("triton.experimental.gluon")
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon_decode

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, str(REPORT), "--gluon", "--head-dims", "128", "256", "512"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    found = {
        (r[0], int(r[1])): (int(r[2]), int(r[3]), int(r[5]))
        for r in rows
        if r and r[0].startswith("turbo")
    }
    assert len(found) == 12, out.stdout
    assumed = gluon_decode.resident_warps()
    assert assumed == 12
    short = {
        case: (registers, spills, per_sm)
        for case, (registers, spills, per_sm) in found.items()
        if registers > gluon_decode.MAX_REGISTERS
        or spills > 32
        or per_sm * (case[1] // gluon_decode.SLICE) < assumed
    }
    assert not short, f"(registers, spill bytes, programs per SM): {short}"


def test_gluon_report_compiles_its_cases_token_stride(monkeypatch):
    """The token stride is a constant of the compiled Gluon stage 1, and
    ptxas allocated differently for one KV head's stride than for the
    model's (3bit_nc at head_dim 256: 186 registers against 203-205 at run
    time): the report compiles the stride of its case's KV heads."""
    pytest.importorskip("triton.experimental.gluon")
    from tests.kernels.attention import gluon_static_compile
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    report = import_benchmark("benchmarks.kernels.compile_report_turboquant_decode")
    strides = []

    def compiled(*args, **kwargs):
        strides.append(args[6])
        raise LookupError("stop after the compile's arguments")

    monkeypatch.setattr(gluon_static_compile, "static_compile", compiled)
    for head_dim, kv_heads in ((128, 8), (256, 4), (512, 4)):
        with pytest.raises(LookupError):
            report.compile_gluon_stage1(
                "turboquant_3bit_nc", head_dim, report.GQA[head_dim], 90
            )
        slot = TurboQuantConfig.from_cache_dtype(
            "turboquant_3bit_nc", head_dim
        ).slot_size_aligned
        assert strides[-1] == slot * kv_heads


@pytest.mark.parametrize("flag", ["--presets", "--head-dims", "--geometries"])
def test_compile_report_refuses_an_empty_list(flag):
    # Not a report of no cases, exit 0.
    status, err = refused(REPORT.name, [flag])
    assert status == 2, err[-2000:]
    assert f"{flag}: expected at least one argument" in err
