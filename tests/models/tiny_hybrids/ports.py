# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ports for engines started side by side.

An engine without ``VLLM_PORT`` takes its torch.distributed port by binding
port 0, closing the socket and binding the number again later; engines
started together on one host can be handed the same number in between (the
release-49 gate lost a cell to ``EADDRINUSE``). Each child engine here gets
its own ``VLLM_PORT``, from which vLLM scans upward: ranges of
``PORTS_PER_CHILD`` ports from the process's base, below Linux's ephemeral
range (32768 up), so no other socket is handed one of them. A process that
starts children beside another such process (the gate's lanes) gets its own
base through ``PORT_BASE_ENV``; processes that run at once inside one range
(the suite lane's tests, each a pytest process whose first engine would
otherwise take the range's first port) split it with ``share_env``.
"""

import itertools
import os
import threading

PORT_BASE_ENV = "HYBRIDKV_PORT_BASE"
# How many children's ranges the process's base holds.
PORT_CHILDREN_ENV = "HYBRIDKV_PORT_CHILDREN"
DEFAULT_BASE = 20000
PORTS_PER_CHILD = 40
CHILDREN_PER_BASE = 50
PORTS_PER_BASE = PORTS_PER_CHILD * CHILDREN_PER_BASE

_children = itertools.count()
_lock = threading.Lock()


def child_port_env() -> dict[str, str]:
    """``VLLM_PORT`` for the next child engine of this process."""
    base = int(os.environ.get(PORT_BASE_ENV, DEFAULT_BASE))
    children = int(os.environ.get(PORT_CHILDREN_ENV, CHILDREN_PER_BASE))
    with _lock:
        i = next(_children) % children
    return {"VLLM_PORT": str(base + PORTS_PER_CHILD * i)}


def share_env(index: int, parts: int) -> dict[str, str]:
    """``PORT_BASE_ENV`` and ``PORT_CHILDREN_ENV`` for the ``index``-th of
    ``parts`` processes that run at once inside this process's range: each
    gets an equal share of its children's ranges, at least one."""
    base = int(os.environ.get(PORT_BASE_ENV, DEFAULT_BASE))
    children = int(os.environ.get(PORT_CHILDREN_ENV, CHILDREN_PER_BASE))
    share = children // parts
    if share < 1 or not 0 <= index < parts:
        raise ValueError(
            f"cannot split {children} children's port ranges into {parts} "
            f"parts (index {index}): run at most {children} processes at once"
        )
    return {
        PORT_BASE_ENV: str(base + PORTS_PER_CHILD * share * index),
        PORT_CHILDREN_ENV: str(share),
    }


def lane_base(index: int) -> str:
    """``PORT_BASE_ENV`` for the ``index``-th of processes started together."""
    return str(DEFAULT_BASE + PORTS_PER_BASE * index)
