# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm --version` and `vllm --help` on a host without a GPU, end to end.

The command runs as its console script does, in its own process, with no
platform hint (HYBRIDKV_TEST_PLATFORM unset, as after a plain install) and
CUDA hidden, so vLLM resolves no platform there.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from vllm import platforms
from vllm.entrypoints.cli.print_only import prints_only, use_cpu_platform_to_print
from vllm.platforms.interface import UnspecifiedPlatform

pytestmark = pytest.mark.cpu_test

LAUNCH = (
    "import sys\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


def vllm(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", LAUNCH, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert "No module named" not in out.stderr, (
        "the serving stack must import for the whole CLI to build; "
        "the test environment lacks one of its packages:\n" + out.stderr
    )
    return out


def test_version_without_a_platform():
    out = vllm("--version")
    assert out.returncode == 0, out.stderr
    assert "Failed to infer device type" not in out.stderr
    # Out-of-tree platform plugins are listed on stdout before it.
    assert out.stdout.splitlines()[-1] == importlib.metadata.version("vllm")


def test_help_without_a_platform():
    out = vllm("--help")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "usage: vllm [-h] [-v]" in out.stdout


@pytest.mark.parametrize(
    ("argv", "printed"),
    [
        ([], True),
        (["--version"], True),
        (["-v"], True),
        (["-h"], True),
        (["serve", "--help"], True),
        (["serve", "--help=ModelConfig"], True),
        (["serve", "Qwen/Qwen3-0.6B"], False),
        (["serve", "-v"], False),
        (["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"], False),
    ],
)
def test_prints_only(argv, printed):
    assert prints_only(argv) is printed


def test_platform_switched_only_to_print(monkeypatch):
    monkeypatch.setattr(platforms, "current_platform", UnspecifiedPlatform())
    use_cpu_platform_to_print(["serve", "Qwen/Qwen3-0.6B"])
    assert platforms.current_platform.is_unspecified()
    use_cpu_platform_to_print(["--version"])
    assert platforms.current_platform.is_cpu()


def test_resolved_platform_kept(monkeypatch):
    resolved = platforms.current_platform
    use_cpu_platform_to_print(["--help"])
    assert platforms.current_platform is resolved
