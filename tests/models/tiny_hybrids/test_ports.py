# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child engines started together get their own VLLM_PORT ranges (ports.py),
and the gate's lanes their own bases, below Linux's ephemeral ports."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.models.tiny_hybrids import ports


def test_children_started_together_get_disjoint_ranges(monkeypatch):
    monkeypatch.delenv(ports.PORT_BASE_ENV, raising=False)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda _: ports.child_port_env(), range(16)))
    starts = sorted(int(env["VLLM_PORT"]) for env in got)
    assert all(b - a >= ports.PORTS_PER_CHILD for a, b in zip(starts, starts[1:]))
    assert starts[0] >= ports.DEFAULT_BASE


def test_each_lane_has_its_own_base(monkeypatch):
    """The gate's five lanes: their ranges never meet, and all stay below
    32768, where the kernel hands out ephemeral ports."""
    ranges = []
    for lane in range(5):
        monkeypatch.setenv(ports.PORT_BASE_ENV, ports.lane_base(lane))
        base = int(ports.lane_base(lane))
        port = int(ports.child_port_env()["VLLM_PORT"])
        assert base <= port < base + ports.PORTS_PER_BASE
        ranges.append((base, base + ports.PORTS_PER_BASE))
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    assert ranges[-1][1] <= 32768


def test_the_gate_gives_each_lane_a_base(monkeypatch, tmp_path):
    from tests import gpu_gate

    seen = []

    class Proc:
        def __init__(self, cmd, env, **kw):
            seen.append(env[ports.PORT_BASE_ENV])
            self.returncode = 0

        def poll(self):
            return 0

    monkeypatch.setattr(gpu_gate.subprocess, "Popen", Proc)
    lanes = [gpu_gate.Lane(name, ["true"], 0) for name in ("a", "b", "c")]
    gpu_gate.run_lanes(lanes, tmp_path, deadline=1e12, t0=0.0)
    assert seen == [ports.lane_base(i) for i in range(3)]


def test_processes_sharing_a_range_split_it(monkeypatch):
    monkeypatch.setenv(ports.PORT_BASE_ENV, ports.lane_base(1))
    monkeypatch.delenv(ports.PORT_CHILDREN_ENV, raising=False)
    shares = [ports.share_env(i, 4) for i in range(4)]
    base = int(ports.lane_base(1))
    starts = [int(s[ports.PORT_BASE_ENV]) for s in shares]
    span = ports.PORTS_PER_CHILD * int(shares[0][ports.PORT_CHILDREN_ENV])
    assert starts == [base + span * i for i in range(4)]
    assert starts[-1] + span <= base + ports.PORTS_PER_BASE
    # A process of one share counts its children inside the share.
    monkeypatch.setenv(ports.PORT_BASE_ENV, shares[3][ports.PORT_BASE_ENV])
    monkeypatch.setenv(ports.PORT_CHILDREN_ENV, shares[3][ports.PORT_CHILDREN_ENV])
    got = {int(ports.child_port_env()["VLLM_PORT"]) for _ in range(2 * 12)}
    assert min(got) == starts[3] and max(got) < starts[3] + span
    with pytest.raises(ValueError, match="at most 12 processes at once"):
        ports.share_env(0, 13)
