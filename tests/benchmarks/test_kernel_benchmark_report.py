# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernel microbenchmark (benchmarks/kernels/
benchmark_turboquant_decode.py) without a GPU."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_documented_command_runs_from_the_repo_root_and_needs_a_gpu():
    # benchmarks/README.md's command, as a file from the repo root: it imports
    # the kernel tests' reference from this checkout, then asks for a GPU.
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/kernels/benchmark_turboquant_decode.py",
            "--quick",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert out.returncode == 1
    assert "needs a CUDA GPU" in out.stderr
