# SPDX-License-Identifier: Apache-2.0
"""Fixtures our tests share with vLLM's own tests/conftest.py, by the same names.

Only what our tests use, so that a patch's tests travel upstream unchanged
(upstream's conftest provides these fixtures there).
"""

import logging

import pytest


@pytest.fixture
def caplog_vllm(caplog):
    """caplog that sees vLLM's records (its logger does not propagate to root)."""
    logger = logging.getLogger("vllm")
    old = logger.propagate
    logger.propagate = True
    try:
        yield caplog
    finally:
        logger.propagate = old
