# SPDX-License-Identifier: Apache-2.0
"""A script run in a child Python whose Triton is the CPU interpreter: the
interpreter is chosen when Triton is imported, and a test session's Triton is
the native one (or vLLM's placeholder)."""

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_interpreted(
    script: Path, *args: str, path: Sequence[Path] = (), timeout: float = 300
) -> dict:
    """The JSON the script prints last; ``path`` goes before this checkout on
    its PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, path), os.getcwd(), *filter(None, [env.get("PYTHONPATH")])]
    )
    run = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
