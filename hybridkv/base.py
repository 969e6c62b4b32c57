"""The pinned vLLM base and where hybridkv keeps what it fetches and builds.

One source of truth for the base: ``requirements/vllm-base.txt`` (pip's own
hash-pinned format), so that pip and this tool can never disagree about which
files are pristine.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_PIN_FILE = REPO / "requirements" / "vllm-base.txt"


def cache_dir() -> Path:
    # Overridable so CI and developers can share one download across checkouts.
    return Path(os.environ.get("HYBRIDKV_CACHE", REPO / ".hybridkv"))


@dataclass(frozen=True)
class Base:
    project: str
    version: str
    sha256: tuple[str, ...]
    release: int

    @property
    def label(self) -> str:
        """The patched distribution's version, a PEP 440 local label."""
        return f"{self.version}+hybridkv.{self.release}"


def _release_number(base_version: str) -> int:
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    prefix, _, release = version.rpartition(".")
    if prefix != base_version or not release.isdigit():
        raise SystemExit(
            f"pyproject.toml: version {version!r} must be '{base_version}.<N>' to match "
            f"the base pinned in {BASE_PIN_FILE.name} (vllm=={base_version})."
        )
    return int(release)


def load_base() -> Base:
    text = BASE_PIN_FILE.read_text()
    # Join pip's backslash continuations, drop comments.
    joined = re.sub(r"\\\n", " ", re.sub(r"#[^\n]*", "", text))
    for line in joined.splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s]+)(.*)", line)
        if m:
            hashes = tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(3)))
            if not hashes:
                raise SystemExit(
                    f"{BASE_PIN_FILE}: the pin {m.group(1)}=={m.group(2)} has no "
                    "--hash=sha256:... entries; add the sha256 of the wheel and sdist."
                )
            return Base(m.group(1), m.group(2), hashes, _release_number(m.group(2)))
    raise SystemExit(f"{BASE_PIN_FILE}: expected a line 'vllm==X.Y.Z --hash=...'.")


def pristine_wheel_dir() -> Path:
    """The pristine wheel, unpacked: the tree patches are checked against."""
    return cache_dir() / "pristine" / "wheel"


def upstream_tests_dir() -> Path:
    """The sdist's tests/ (and pyproject.toml), without its vllm/ sources.

    The sdist's vllm/ is left out on purpose: beside tests/ it would shadow the
    installed, patched vllm on sys.path.
    """
    return cache_dir() / "pristine" / "upstream-tests"


def downloads_dir() -> Path:
    return cache_dir() / "downloads"
