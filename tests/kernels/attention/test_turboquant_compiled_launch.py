# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's store and decode launch their compiled kernels without the
Triton JIT once a shape has run, and compute the same bits as through it.

A step that no full CUDA graph covers runs each layer's cache update and
decode eagerly; there every ``kernel[grid](...)`` paid the JIT's
bookkeeping (47-80 µs a launch on an H100 host, the Gluon stage 1 most).
Without ``vllm.triton_utils.compiled_launch`` every launch goes through
``JITFunction.run``.
"""

import pytest
import torch
from triton.runtime.jit import JITFunction

from tests.kernels.attention.turboquant_packed import decode, packed_case, tables
from vllm.triton_utils import compiled_launch
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store

pytestmark = pytest.mark.gpu

HQ, HK, D = 16, 4, 128


def _step(preset: str, rows: int):
    """One eager decode step (a new token stored per row, then the decode),
    as a function returning the output."""
    cfg, centroids, pit, cache, table = packed_case(preset, D, [300] * rows, HK, "cuda")
    _, midpoints, _ = tables(cfg, D, "cuda")
    seq = torch.full((rows,), 300, dtype=torch.int32, device="cuda")
    slots = (table[:, 299 // 16].long() * 16 + 299 % 16).to(torch.int32)
    k = torch.randn(rows, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16)
    mid = torch.empty(rows, HQ, 32, D + 1, device="cuda")

    def step():
        turboquant_store(
            k,
            v,
            cache,
            slots,
            pit,
            midpoints,
            cfg.key_mse_bits,
            cfg.key_packed_size,
            cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
        )
        out = decode(q, cache, table, seq, cfg, centroids, pit, mid_o_buf=mid)
        torch.cuda.synchronize()
        return out.clone()

    return step


@pytest.fixture(autouse=True)
def fresh_launchers(monkeypatch):
    """Nothing an earlier test compiled is launched directly here: each
    test's first step goes through the JIT (whose own cache it may hit),
    and no decode plan of an earlier test is sent again."""
    for launch in compiled_launch._launchers.values():
        monkeypatch.setattr(launch, "_compiled", {})
    monkeypatch.setattr(tq_decode, "_plans", {})


@pytest.fixture
def jit_runs(monkeypatch):
    runs = []
    jit_run = JITFunction.run

    def counted(self, *args, **kwargs):
        runs.append(self.fn.__name__)
        return jit_run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return runs


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
@pytest.mark.parametrize("rows", [2, 64])
def test_a_repeated_step_launches_without_the_jit(preset, rows, jit_runs):
    step = _step(preset, rows)
    first = step()
    assert jit_runs, "the first step launched nothing through the JIT"
    jit_runs.clear()
    again = step()
    assert jit_runs == [], f"launched through the JIT again: {jit_runs}"
    assert torch.equal(first, again)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_direct_launches_compute_the_jits_bits(preset, monkeypatch):
    step = _step(preset, 64)
    step()
    direct = step()
    for launch in compiled_launch._launchers.values():
        monkeypatch.setattr(launch, "enabled", False)
    # The decode's plan would launch directly: none is kept or sent.
    monkeypatch.setattr(tq_decode, "_plans", {})
    monkeypatch.setattr(tq_decode, "MAX_PLANS", 0)
    through_jit = step()
    assert not torch.isnan(direct).any()
    assert torch.equal(direct, through_jit)
