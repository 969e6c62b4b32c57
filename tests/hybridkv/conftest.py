# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the series tooling's tests: the pristine base and small copies of it."""

import shutil
from pathlib import Path

import pytest

from hybridkv.base import pristine_wheel_dir
from hybridkv.fetch import fetch, unpack
from hybridkv.series import load_series


@pytest.fixture(scope="session")
def pristine_root() -> Path:
    """The pristine wheel, unpacked (fetched from PyPI once if this checkout has
    none)."""
    if not (pristine_wheel_dir() / ".from").exists():
        unpack(fetch())
    return pristine_wheel_dir()


@pytest.fixture(scope="session")
def series():
    return load_series()


@pytest.fixture
def small_tree(tmp_path, pristine_root, series) -> Path:
    """A vLLM tree holding only what the series touches, plus the dist-info."""
    root = tmp_path / "site-packages"
    for rel in series.hooked_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine_root / rel, root / rel)
    info = next(pristine_root.glob("vllm-*.dist-info"))
    shutil.copytree(info, root / info.name)
    return root


# What a checkout needs for the series tool to run in it: its code, its series,
# the files the series owns and the pins it reads.
CHECKOUT_PARTS = (
    "hybridkv",
    "patches",
    "requirements",
    "vllm",
    "tests",
    "pyproject.toml",
)


@pytest.fixture
def repo_copy(tmp_path, pristine_root) -> Path:
    """A copy of this checkout in tmp_path (another clone, as far as the tool
    can tell), sharing this checkout's download cache through HYBRIDKV_CACHE."""
    from hybridkv.base import REPO

    copy = tmp_path / "clone"
    for part in CHECKOUT_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(
                src, copy / part, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copyfile(src, copy / part)
    return copy
