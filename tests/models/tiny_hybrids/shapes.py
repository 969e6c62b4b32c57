# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shape records of the full-size models named in hybridkv's bug reports.

Each ``full_size/<file>.json`` is a config.json-shaped dict holding only shape
facts, plus a top-level ``_source`` saying which numbers come from files and
which from memory. They let planning tests (page sizes, boundary skips, backend
selection) use real geometry without weights or hub access.
"""

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

_DIR = Path(__file__).parent / "full_size"

# Model name (as the bug reports spell it) -> record file.
_FILES = {
    "Qwen3.6-27B": "qwen3_6_27b.json",
    "Qwen3-Coder-Next-80B-A3B": "qwen3_coder_next_80b_a3b.json",
    "LocoOperator-4B": "locooperator_4b.json",
    "Gemma-4-31B": "gemma_4_31b.json",
    "Qwen3-4B": "qwen3_4b.json",
}

FULL_SIZE_MODELS: tuple[str, ...] = tuple(_FILES)


@cache
def _read(name: str) -> dict[str, Any]:
    if name not in _FILES:
        raise KeyError(f"unknown full-size model {name!r}; known: {FULL_SIZE_MODELS}")
    return json.loads((_DIR / _FILES[name]).read_text())


def load_full_size(name: str) -> dict[str, Any]:
    """The record for ``name`` (a fresh copy, ``_source`` included)."""
    return copy.deepcopy(_read(name))


def write_full_size_config(name: str, path: str | Path) -> Path:
    """Write ``name``'s record as ``path/config.json`` (no weights) and return ``path``.

    Keys starting with ``_`` are dropped so transformers does not turn them
    into config attributes.
    """
    config = {k: v for k, v in load_full_size(name).items() if not k.startswith("_")}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
