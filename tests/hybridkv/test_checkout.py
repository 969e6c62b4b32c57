# SPDX-License-Identifier: Apache-2.0
"""The `hybridkv` command works on the checkout the current directory is in,
as `python -m hybridkv` run there does, not on the one it was installed from."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.base import REPO, cache_dir

SCRIPT = Path(sys.executable).parent / "hybridkv"


def _run(argv, cwd):
    env = {**os.environ, "HYBRIDKV_CACHE": str(cache_dir())}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(
    not SCRIPT.exists(), reason="no `hybridkv` script beside this Python"
)
def test_the_console_script_follows_the_checkout_it_runs_in(repo_copy, small_tree):
    # Something only the other clone has: a patch file its series does not list.
    stray = repo_copy / "patches" / "core" / "9999-stray.patch"
    stray.write_text("x\n")
    check = ["check", "--tree", str(small_tree)]

    by_module = _run([sys.executable, "-m", "hybridkv", *check], repo_copy)
    assert by_module.returncode == 1, by_module.stdout + by_module.stderr
    assert "patches/core/9999-stray.patch: not listed in patches/series" in (
        by_module.stdout
    )
    for cwd in (repo_copy, repo_copy / "patches" / "core"):
        out = _run([str(SCRIPT), *check], cwd)
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stdout == by_module.stdout
        assert f"checkout {repo_copy}" in out.stderr, out.stderr

    # In the checkout it was installed from, and outside any checkout, it
    # works on the installed one.
    for cwd in (REPO, small_tree.parent):
        out = _run([str(SCRIPT), *check], cwd)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "9999-stray" not in out.stdout + out.stderr
