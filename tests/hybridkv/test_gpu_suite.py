# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu-suite.sh and scripts/gpu-gate.sh, the GPU host's test commands,
on bad input."""

import os
import subprocess

import pytest

from hybridkv.base import REPO


@pytest.mark.parametrize(
    "script, writes", [("gpu-suite.sh", "gpu-suite.log"), ("gpu-gate.sh", "gate")]
)
def test_a_prefix_without_a_runtime_is_named_before_anything_runs(
    script, writes, tmp_path
):
    # It ran pytest against whatever python3 found: tracebacks (no torch
    # here, or the host's pristine vLLM there) in place of the reason.
    out = subprocess.run(
        ["bash", f"scripts/{script}", str(tmp_path / "nowhere")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OUT=str(tmp_path)),
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"no vLLM runtime under {tmp_path / 'nowhere'}" in out.stderr
    assert "unpack.sh PREFIX" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / writes).exists()
