# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny random-weight model fixtures and full-size shape records.

- ``builders``: write config.json for tiny Qwen3.5/3.6, Qwen3-Next, Gemma 4
  (multimodal) and dense Qwen3 models (optionally with a local tokenizer).
- ``shapes``: config.json-shaped records of the full-size models in the bug
  reports, for planning tests that never load weights.
"""

from .builders import BUILDERS, gemma4_mm, qwen3_5_text, qwen3_dense, qwen3_next
from .shapes import FULL_SIZE_MODELS, load_full_size, write_full_size_config

__all__ = [
    "BUILDERS",
    "FULL_SIZE_MODELS",
    "gemma4_mm",
    "load_full_size",
    "qwen3_5_text",
    "qwen3_dense",
    "qwen3_next",
    "write_full_size_config",
]
