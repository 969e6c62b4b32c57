# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import importlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def import_benchmark(name: str):
    """A script under benchmarks/ as a module (``benchmarks.kernels.X``),
    imported from this checkout."""
    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO))


def import_kernel_helper(name: str):
    """A module the kernel benchmarks share (benchmarks/kernels/NAME.py),
    imported by its plain name as the scripts import it, so that a test
    patches the object the scripts' calls look up."""
    folder = str(REPO / "benchmarks" / "kernels")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def readme_command(pattern: str) -> str:
    """The one command of benchmarks/README.md that ``pattern`` (a regex whose
    group 1 is the command, without its backquotes) matches."""
    readme = (REPO / "benchmarks" / "README.md").read_text()
    (command,) = re.findall(pattern, readme)
    return command
