# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engines that share compiled kernels start after the first of them.

On a fresh GPU host every engine of a matrix compiles its Triton kernels and
Inductor graphs, and engines of one checkpoint and KV dtype compile the same
ones. Started together, a dozen processes compile the same kernels side by
side on a few cores, and each takes minutes (16 engines at once timed out 4
cells at 240 s). Here the first engine of each group (its leader) runs
alone for its group and fills the shared caches; the rest of the group
starts when it ends and loads what it compiled.
"""

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# What a matrix records for an engine its deadline left unstarted; the gate
# reads it back to tell cut cells from failed ones.
NOT_RUN = "NOT RUN (deadline)"


def run_grouped(
    items: Sequence[T],
    group: Callable[[T], Hashable],
    run: Callable[[T], R],
    jobs: int,
) -> list[R]:
    """``run(item)`` for every item, ``jobs`` at a time, results in item
    order. The first item of each group starts before any other of its
    group; the others are queued (in item order) once it has ended."""
    members: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        members.setdefault(group(item), []).append(i)
    results: dict[int, R] = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        running: dict[Future, int] = {
            pool.submit(run, items[idx[0]]): idx[0] for idx in members.values()
        }
        followers = {idx[0]: idx[1:] for idx in members.values()}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                i = running.pop(future)
                results[i] = future.result()
                for j in followers.pop(i, []):
                    running[pool.submit(run, items[j])] = j
    return [results[i] for i in range(len(items))]
