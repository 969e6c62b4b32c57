# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of scheduling.run_grouped: a group's leader runs before the rest
of its group, other groups' leaders run beside it, results keep item order."""

import threading
import time

import pytest

from .scheduling import run_grouped

pytestmark = pytest.mark.cpu_test


def test_followers_start_after_their_leader_ends():
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def run(item):
        with lock:
            events.append(("start", item))
        time.sleep(0.05 if item.endswith("0") else 0.01)
        with lock:
            events.append(("end", item))
        return item.upper()

    items = ["a0", "b0", "a1", "a2", "b1"]
    assert run_grouped(items, lambda s: s[0], run, jobs=4) == [
        "A0", "B0", "A1", "A2", "B1",
    ]  # fmt: skip
    order = [e for e in events]
    for group in "ab":
        leader_end = order.index(("end", f"{group}0"))
        for item in items:
            if item[0] == group and item != f"{group}0":
                assert order.index(("start", item)) > leader_end
    # Both leaders were running at once.
    assert order.index(("start", "b0")) < order.index(("end", "a0"))


def test_a_leader_that_raises_stops_the_run():
    def run(item):
        if item == "a0":
            raise RuntimeError("boom")
        return item

    with pytest.raises(RuntimeError, match="boom"):
        run_grouped(["a0", "a1"], lambda s: s[0], run, jobs=2)
