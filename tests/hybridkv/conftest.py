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
