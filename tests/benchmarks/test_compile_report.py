# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/README.md's GPU-less command: the decode kernels' sm_90 compile
report, for the Triton stage 1 and (``--gluon``) the Gluon one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = (
    Path(__file__).resolve().parents[2]
    / "benchmarks/kernels/compile_report_turboquant_decode.py"
)


@pytest.mark.parametrize("extra", [[], ["--gluon"]])
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
    if extra:  # preset, head_dim, registers, spill bytes, shared, programs/SM, loop
        fields = rows[0].split()
        assert int(fields[2]) <= 255 and int(fields[3]) == 0, rows[0]


def test_compile_report_names_a_head_dim_it_has_no_case_for():
    out = subprocess.run(
        [sys.executable, str(REPORT), "--head-dims", "100"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert (
        "--head-dims: invalid choice: 100 (choose from 64, 128, 256, 512)" in out.stderr
    )
