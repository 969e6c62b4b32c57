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
base through ``PORT_BASE_ENV``.
"""

import itertools
import os
import threading

PORT_BASE_ENV = "HYBRIDKV_PORT_BASE"
DEFAULT_BASE = 20000
PORTS_PER_CHILD = 40
CHILDREN_PER_BASE = 50
PORTS_PER_BASE = PORTS_PER_CHILD * CHILDREN_PER_BASE

_children = itertools.count()
_lock = threading.Lock()


def child_port_env() -> dict[str, str]:
    """``VLLM_PORT`` for the next child engine of this process."""
    base = int(os.environ.get(PORT_BASE_ENV, DEFAULT_BASE))
    with _lock:
        i = next(_children) % CHILDREN_PER_BASE
    return {"VLLM_PORT": str(base + PORTS_PER_CHILD * i)}


def lane_base(index: int) -> str:
    """``PORT_BASE_ENV`` for the ``index``-th of processes started together."""
    return str(DEFAULT_BASE + PORTS_PER_BASE * index)
