# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check the tools a JIT shells out to before choosing a kernel that needs them.

FlashInfer compiles kernels at first use by running ``nvcc`` and ``ninja``
from ``PATH``. vLLM depends on the ``ninja`` package, but its binary sits in
the environment's ``bin/``, which is not on ``PATH`` when a service runs the
environment's python directly. The JIT then fails deep inside a worker with a
bare ``[Errno 2] No such file or directory: 'ninja'``.

So: if the ``ninja`` package is installed but its binary is not on ``PATH``,
put its directory on ``PATH`` for this process (and the processes it starts).
If there is no ninja at all, the caller disables that JIT path with one warning
naming the tool and the fix, and vLLM uses a kernel that needs no JIT.
"""

import os
import shutil
import sys

from vllm.logger import init_logger

logger = init_logger(__name__)


def _ninja_package_dirs() -> list[str]:
    try:
        import ninja
    except ImportError:
        return []
    # BIN_DIR is where the package's own binary lives; the interpreter's
    # directory holds the console script of a venv install.
    return [
        d
        for d in (getattr(ninja, "BIN_DIR", None), os.path.dirname(sys.executable))
        if d
    ]


def ensure_ninja_on_path() -> str | None:
    """The ninja binary JITs will run (put on PATH if needed); None if there is none."""
    found = shutil.which("ninja")
    if found:
        return found
    for directory in _ninja_package_dirs():
        candidate = shutil.which("ninja", path=directory)
        if candidate:
            os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")
            logger.info_once(
                "ninja was not on PATH; using the ninja package's binary %s (added "
                "%s to PATH for this process and its children).",
                candidate,
                directory,
            )
            return candidate
    return None


def jit_tools_available(user: str, tools: tuple[str, ...] = ("ninja",)) -> bool:
    """Whether ``user``'s JIT can run; warns once, naming what is missing and how."""
    missing = [
        t
        for t in tools
        if (ensure_ninja_on_path() if t == "ninja" else shutil.which(t)) is None
    ]
    if not missing:
        return True
    logger.warning_once(
        "%s kernels are disabled: they are JIT-compiled with %s, which %s not on PATH "
        "(%s). vLLM uses kernels that need no JIT instead. To enable them, install the "
        "tool in this environment (pip install ninja; nvcc comes with the CUDA "
        "toolkit) or add its directory to PATH.",
        user,
        " and ".join(missing),
        "is" if len(missing) == 1 else "are",
        os.environ.get("PATH", ""),
    )
    return False
