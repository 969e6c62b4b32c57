# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The split-KV TurboQuant decode compiles once per layer shape.

Its split count follows the batch size. Steps outside the captured CUDA
graphs (a mixed prefill/decode step, any batch size) launch the kernels
eagerly, so a split count that is part of the compiled kernel made such a
step compile first: about a second on an H100, mid-benchmark.

In the Triton interpreter session (``HYBRIDKV_TRITON_INTERPRET=1``) these
tests compute the key Triton's launcher caches compiled kernels under (its own
binder for an sm_90 target) for every launch the decode makes; no kernel runs.
On a GPU the launch itself is counted.
"""

import importlib

import pytest
import torch

from tests.kernels.attention.turboquant_packed import (
    decode,
    packed_case,
    stored_cache,
    tables,
)
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as splitkv
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops import turboquant_device

pytest.importorskip("triton.experimental.gluon")
gluon_decode = importlib.import_module("vllm.v1.attention.ops.gluon_turboquant_decode")

# Qwen3-4B's attention (32 query / 8 KV heads x 128) on an H100's 132 SMs,
# and the backend's scratch: 32 splits per row for up to 64 rows.
HQ, HK, D, SMS, ROWS = 32, 8, 128, 132, 64


class _CompileKeys:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the key
    its launcher would look the compiled kernel up by, and the grid."""

    def __init__(self, kernel):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # The interpreter's stand-in keeps the decorator's arguments.
        jit = (
            kernel
            if hasattr(kernel, "params")
            else JITFunction(kernel.fn, **kernel.kwargs)
        )
        self.binder = create_function_from_signature(
            jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32))
        )
        self.keys: set[str] = set()
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.add(grid, args, kwargs)

        return launch

    def add(self, grid, args, kwargs):
        from triton.runtime.jit import compute_cache_key

        _, specialization, options = self.binder(*args, **kwargs)
        self.keys.add(compute_cache_key({}, specialization, options))
        self.grids.append(tuple(grid))


def _launch_keys(monkeypatch, preset, gluon, batches):
    """Every compile key of the decode's kernels over ``batches``."""
    monkeypatch.setattr(turboquant_device, "_sm_counts", {("cpu", 0): SMS})
    stage1 = _CompileKeys(
        gluon_decode._stage1 if gluon else splitkv._tq_decode_split_stage1
    )
    merge = _CompileKeys(splitkv._tq_decode_split_merge)
    monkeypatch.setattr(splitkv, "_tq_decode_split_stage1", stage1)
    monkeypatch.setattr(splitkv, "_tq_decode_split_merge", merge)
    monkeypatch.setattr(
        tq_decode, "gluon_stage1", lambda d: gluon_decode if gluon else None
    )
    monkeypatch.setattr(
        gluon_decode,
        "_launch",
        lambda kernel, grid, args, constexprs: stage1.add(
            grid, args, {**constexprs, "num_warps": constexprs["W"]}
        ),
    )
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg, centroids, pit, cache, table = packed_case(preset, D, [40], HK, "cpu")
    mid = torch.empty(ROWS, HQ, 32, D + 1)
    out = torch.empty(max(batches), HQ, D, dtype=torch.bfloat16)
    for batch in batches:
        decode(
            torch.randn(batch, HQ, D).to(torch.bfloat16),
            cache,
            table[:1].repeat(batch, 1),  # the backend's: one stride
            torch.full((batch,), 40, dtype=torch.int32),
            cfg,
            centroids,
            pit,
            mid_o_buf=mid,
            output_buf=out,
        )
    return stage1, merge


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_every_batch_size_reuses_one_compiled_decode(
    triton_interpret, monkeypatch, preset, gluon
):
    # Batch 1..96: the Gluon stage 1 splits 1-128 ways, the Triton one 1-32.
    stage1, merge = _launch_keys(monkeypatch, preset, gluon, range(1, 97))
    splits = sorted({g[2] for g in stage1.grids})
    assert len(splits) > 4, f"the batches tried only split {splits} ways"
    # One compile for the split counts > 1, one for a single split (the
    # first kernel writes the output itself).
    assert len(stage1.keys) == 1 + (1 in splits), (
        f"stage 1 compiles {len(stage1.keys)} kernels for split counts "
        f"{splits}; every count must share one (a launch argument)"
    )
    assert len(merge.keys) == 1, (
        f"the merge compiles {len(merge.keys)} kernels for split counts {splits}"
    )


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_stage1_grids_put_the_splits_last(triton_interpret, monkeypatch, gluon):
    # A GPU hands blocks out x first: with the splits last, every row's
    # first split goes out before any second one (the live ones of a batch
    # of short rows first; test_turboquant_decode_gluon runs it).
    batches = range(1, 97)
    stage1, _ = _launch_keys(monkeypatch, "turboquant_k8v4", gluon, batches)
    assert [g[:2] for g in stage1.grids] == [(HK, b) for b in batches]
    assert max(g[2] for g in stage1.grids) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_decode_compiles_once_for_every_batch_size_gpu(preset):
    """Batches 1-96 at Qwen3-4B's shape, with the backend's scratch."""
    device = "cuda"
    torch.manual_seed(11)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints, pit = tables(cfg, D, device)
    cache, table = stored_cache(cfg, [600], HK, D, device, pit, midpoints)
    mid = torch.empty(ROWS, HQ, 32, D + 1, device=device)
    out = torch.empty(96, HQ, D, dtype=torch.bfloat16, device=device)

    def compiled():
        caches = [
            k.device_caches[torch.accelerator.current_device_index()][0]
            for k in (
                gluon_decode._stage1,
                splitkv._tq_decode_split_stage1,
                splitkv._tq_decode_split_merge,
            )
        ]
        return sum(len(c) for c in caches)

    def step(batch):
        return decode(
            torch.randn(batch, HQ, D, device=device).to(torch.bfloat16),
            cache,
            table[:1].repeat(batch, 1),
            torch.full((batch,), 600, dtype=torch.int32, device=device),
            cfg,
            centroids,
            pit,
            mid_o_buf=mid,
            output_buf=out,
        )

    step(1)  # the split kernels, compiled here or by earlier tests
    step(96)
    before = compiled()
    for batch in range(2, 96):
        step(batch)
    torch.accelerator.synchronize()
    assert compiled() == before, (
        f"batches 2-95 compiled {compiled() - before} more decode kernels"
    )
