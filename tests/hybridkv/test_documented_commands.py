# SPDX-License-Identifier: Apache-2.0
"""The README's promises, checked: its commands run as written, its versions are
the ones this checkout builds."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from hybridkv.base import REPO, load_base

README = (REPO / "README.md").read_text()


def _blocks() -> list[str]:
    """The fenced code blocks of the README, in order."""
    blocks, current = [], None
    for line in README.splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_install_line_names_the_wheel_this_checkout_builds():
    base = load_base()
    # Gate records keep the name of the release they gated (gates/<version>.md).
    numbered = set(re.findall(r"(?<!gates/0\.20\.2\+)hybridkv\.(\d+)", README))
    assert numbered <= {str(base.release)}, (
        f"README names hybridkv release(s) {sorted(numbered)}; this checkout builds "
        f"{base.label} (pyproject.toml)"
    )
    assert f"pip install dist/vllm-{base.label}-" in README


def test_python_version_claim_is_true():
    with open(REPO / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["project"]["requires-python"]
    claimed = re.search(r"Python (3\.\d+)\+", README).group(1)
    assert requires == f">={claimed}"
    # The tooling's own imports set the floor: tomllib is 3.11+.
    uses_tomllib = any(
        re.search(r"^import tomllib", p.read_text(), re.M)
        for p in (REPO / "hybridkv").rglob("*.py")
    )
    if uses_tomllib:
        assert tuple(int(x) for x in claimed.split(".")) >= (3, 11)


def _kv_capacity_command() -> str:
    for block in _blocks():
        if block.lstrip().startswith("vllm kv-capacity"):
            return block.replace("\\\n", " ")
    raise AssertionError("README has no ``` block starting with `vllm kv-capacity`")


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "vllm").exists(),
    reason="no `vllm` console script beside this Python",
)
def test_readme_kv_capacity_command_runs_as_written(tmp_path):
    """Without any platform hint (a plain install on a GPU-less host)."""
    sys.path.insert(0, str(REPO))
    from tests.models.tiny_hybrids.shapes import write_full_size_config

    model = write_full_size_config("Qwen3.6-27B", tmp_path / "Qwen3.6-27B")
    argv = shlex.split(_kv_capacity_command())
    assert argv[:3] == ["vllm", "kv-capacity", "MODEL_DIR"]
    argv[0] = str(Path(sys.executable).parent / "vllm")
    argv[2] = str(model)
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "layer KV dtypes: {'turboquant_4bit_nc': 16}" in out.stdout
    assert re.search(r"KV cache: [\d,]+ tokens", out.stdout)
    assert "TURBOQUANT" in out.stdout


def _version_command() -> str:
    for block in _blocks():
        for line in block.splitlines():
            if line.startswith("vllm --version"):
                return line.split("#", 1)[0].strip()
    raise AssertionError("README has no ``` block line starting with `vllm --version`")


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "vllm").exists(),
    reason="no `vllm` console script beside this Python",
)
def test_readme_version_command_runs_without_a_gpu():
    """As after a plain install on a host where vLLM detects no platform:
    no platform hint, CUDA hidden (0.20.2: "Failed to infer device type")."""
    import importlib.metadata

    argv = shlex.split(_version_command())
    argv[0] = str(Path(sys.executable).parent / "vllm")
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    # Out-of-tree platform plugins (this repo's, when installed) are listed first.
    assert out.stdout.splitlines()[-1] == importlib.metadata.version("vllm")
