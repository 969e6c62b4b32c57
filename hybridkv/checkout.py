"""Which checkout a `hybridkv` command works on: the one the current directory is in.

The `hybridkv` console script of an editable install imports the checkout it
was installed from, wherever it runs; `python -m hybridkv` imports the one in
the current directory. Run inside another clone, the two answered for
different series. A command run inside a hybridkv checkout (a directory with
``patches/series`` and ``hybridkv/``, at the current directory or above it)
therefore runs that checkout's own tool, code and series together, as
`python -m hybridkv` run at its root does; outside any checkout it works on
the one it was installed from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hybridkv.base import REPO

# Set for the process that runs another checkout's tool: had that process
# still imported this checkout, following again would never end.
FOLLOWED = "HYBRIDKV_FOLLOWED_CHECKOUT"


def checkout_of(start: Path) -> Path | None:
    """The hybridkv checkout holding ``start`` (the nearest one above it), if any."""
    for d in (start, *start.parents):
        if (d / "patches" / "series").is_file() and (d / "hybridkv" / "cli.py").is_file():
            return d
    return None


def follow_current_checkout(argv: list[str]) -> None:
    """Run ``argv`` with the tool of the checkout the current directory is
    in, when that is not this one; returns only when it is this one."""
    # Read once and dropped, so that the tools this command starts follow afresh.
    followed = os.environ.pop(FOLLOWED, None)
    try:
        here = checkout_of(Path.cwd().resolve())
    except OSError:
        return  # the current directory is gone; nothing to follow
    if here is None or here == REPO.resolve():
        return
    if followed == str(here):
        raise SystemExit(
            f"the current directory is in the hybridkv checkout {here}, but its tool "
            f"did not load there (this is {REPO}'s). Check that {here}/hybridkv/ is "
            f"complete, then run `python -m hybridkv` in {here}."
        )
    print(f"hybridkv: working on the checkout {here} (the current directory's); "
          f"this `hybridkv` was installed from {REPO}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env[FOLLOWED] = str(here)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), env.get("PYTHONPATH")]))
    # -P: the current directory stays off sys.path, so a hybridkv/ folder
    # there (tests/hybridkv/ of a checkout) cannot stand in for the tool.
    os.execve(sys.executable, [sys.executable, "-P", "-m", "hybridkv", *argv], env)
