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


def refused(script: str, args: list[str]) -> tuple[int, str]:
    """``python benchmarks/kernels/SCRIPT ARGS``, whose argument checks must
    end it before anything runs, run in this process (a process of its own
    costs ~1.3 s of imports): its exit status and what it wrote to stderr.
    A call the checks let through raises AssertionError once it ends."""
    import contextlib
    import io

    module = import_benchmark(f"benchmarks.kernels.{script.removesuffix('.py')}")
    err = io.StringIO()
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stderr(err):
            module.main()
    except SystemExit as exit:
        return exit.code, err.getvalue()
    finally:
        sys.argv = argv
    raise AssertionError(f"{script} {' '.join(args)} ran instead of refusing")


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
