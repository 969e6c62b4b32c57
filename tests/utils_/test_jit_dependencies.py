# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""JIT tools are checked before a kernel that needs them is chosen (Gate 4).

Seed: a service runs a venv's python directly, so the venv's ``bin/`` (where
the ``ninja`` package puts its binary) is not on PATH, and FlashInfer's JIT
fails inside a worker with a bare ``[Errno 2] No such file or directory:
'ninja'``.
"""

import importlib.util
import shutil
import subprocess
import sys

import pytest

from vllm.utils import flashinfer

pytestmark = pytest.mark.cpu_test

real_which = shutil.which
real_find_spec = importlib.util.find_spec


@pytest.fixture
def flashinfer_installed_without_cubins(monkeypatch, tmp_path):
    """FlashInfer importable and nvcc present, in a PATH that holds nothing else."""
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            object()
            if name == "flashinfer"
            else None
            if name == "flashinfer_cubin"
            else real_find_spec(name, *a)
        ),
    )
    monkeypatch.setattr(
        shutil,
        "which",
        lambda cmd, mode=1, path=None: (
            "/usr/local/cuda/bin/nvcc" if cmd == "nvcc" else real_which(cmd, mode, path)
        ),
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("VLLM_HAS_FLASHINFER_CUBIN", raising=False)
    flashinfer.has_flashinfer.cache_clear()
    flashinfer.has_flashinfer_cubin.cache_clear()
    yield
    flashinfer.has_flashinfer.cache_clear()
    flashinfer.has_flashinfer_cubin.cache_clear()


def run_flashinfer_jit() -> str:
    """What FlashInfer's JIT does first when vLLM picks it: run ninja from PATH."""
    if not flashinfer.has_flashinfer():
        return "not used"
    return subprocess.run(
        ["ninja", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_ninja_package_off_path_is_put_on_path(flashinfer_installed_without_cubins):
    # pristine: FileNotFoundError: [Errno 2] No such file or directory: 'ninja'
    version = run_flashinfer_jit()
    assert version[0].isdigit()
    assert shutil.which("ninja") is not None


def test_no_ninja_at_all_disables_the_jit_with_one_warning(
    flashinfer_installed_without_cubins, monkeypatch, caplog_vllm
):
    monkeypatch.setitem(sys.modules, "ninja", None)  # the package is not installed

    # pristine: FileNotFoundError: [Errno 2] No such file or directory: 'ninja'
    assert run_flashinfer_jit() == "not used"
    (warning,) = [
        r.getMessage() for r in caplog_vllm.records if r.levelname == "WARNING"
    ]
    assert "FlashInfer kernels are disabled" in warning and "ninja" in warning
    assert "pip install ninja" in warning


def test_gdn_prefill_does_not_pick_flashinfer_when_it_is_not_installed(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.mamba import gdn_linear_attn
    from vllm.platforms import current_platform

    # Hopper, where "auto" prefers FlashInfer's GDN prefill kernel.
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_device_capability", lambda cap: cap == 90)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (None if name == "flashinfer" else real_find_spec(name, *a)),
    )
    flashinfer.has_flashinfer.cache_clear()
    try:
        with set_current_vllm_config(VllmConfig()):
            op = gdn_linear_attn.ChunkGatedDeltaRule()
    finally:
        flashinfer.has_flashinfer.cache_clear()
    # pristine: forward_cuda, whose first prefill raises
    # ModuleNotFoundError: No module named 'flashinfer' (seen on an H100).
    assert op._forward_method == op.forward_native
