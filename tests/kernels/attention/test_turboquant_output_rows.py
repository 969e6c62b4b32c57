# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's forward writes attention straight into the layer's output.

0.20.2 attends into tensors of its own and copies them into the output the
layer hands in (a mixed step: a zeroed temporary, two copies into it, one
out of it). Here FlashAttention, the split-KV decode and SDPA are handed the
output's rows. The step is test_turboquant_prefill_batch.py's: a decode row,
two first chunks and a continuation, through the real builder and forward,
FlashAttention a float64 stand-in. A dispatch mode records every write into
the output's storage that is not a kernel writing its own result there
(the stand-in, or a Triton launch, which the interpreter writes back in
place). Runs under the Triton CPU interpreter (``HYBRIDKV_TRITON_INTERPRET=1``)
and natively on a GPU.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tests.kernels.attention import test_turboquant_prefill_batch as prefill_tests
from tests.kernels.attention.test_turboquant_prefill_batch import (
    HQ,
    TOL,
    D,
    _error,
    _run,
)
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.backends.turboquant_output_rows import output_rows, place

_FORWARD = turboquant_attn.TurboQuantAttentionImpl.forward


class WritesInto(TorchDispatchMode):
    """Mutating ops on ``target``'s storage whose source is other memory."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.storage = target.untyped_storage().data_ptr()
        self.writes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dst = args[0] if args else None
        if (
            func._schema.is_mutable
            and isinstance(dst, torch.Tensor)
            and dst.untyped_storage().data_ptr() == self.storage
        ):
            src = args[1] if len(args) > 1 else None
            if not (isinstance(src, torch.Tensor) and src.data_ptr() == dst.data_ptr()):
                self.writes.append(f"{func}{tuple(dst.shape)}")
        return func(*args, **kwargs)


@pytest.fixture
def flash(monkeypatch):
    """The prefill tests' FlashAttention stand-in (``_watch`` installs it)."""
    monkeypatch.setattr(turboquant_attn, "_HAS_FLASH_ATTN", True)
    monkeypatch.setattr(turboquant_attn, "get_flash_attn_version", lambda **kw: 2)
    return prefill_tests.FlashStandIn()


def _watch(monkeypatch, flash_stand_in, output_dtype=None):
    """Run every forward under ``WritesInto(output)``; FlashAttention's own
    writes (into ``out=``) are the kernel's. ``output_dtype`` hands the
    forward an output of another dtype than the query's."""
    seen = SimpleNamespace(writes=None, output=None)

    def kernel(*args, **kwargs):
        # FlashAttention's writes into out= are the kernel's own (and its
        # custom op does not pass through a Python dispatch mode).
        with _disable_current_modes():
            return flash_stand_in(*args, **kwargs)

    def watched(self, layer, query, key, value, kv_cache, meta, output=None, **kw):
        if output_dtype is not None:
            output = output.to(output_dtype)
        mode = WritesInto(output)
        with mode:
            result = _FORWARD(self, layer, query, key, value, kv_cache, meta, output)
        seen.writes, seen.output = mode.writes, output
        return result

    monkeypatch.setattr(
        turboquant_attn, "flash_attn_varlen_func", kernel, raising=False
    )
    monkeypatch.setattr(turboquant_attn.TurboQuantAttentionImpl, "forward", watched)
    return seen


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_a_mixed_step_attends_into_the_layer_output(
    preset, triton_device, flash, monkeypatch
):
    seen = _watch(monkeypatch, flash)
    run = _run(preset, triton_device, monkeypatch)
    assert seen.writes == [], f"copies into the layer output: {seen.writes}"
    assert [o is not None for o in flash.outs] == [True]
    # Every row was written (the output started as NaN), and by FlashAttention
    # into the output's own rows past the decode row.
    assert not run.out.isnan().any()
    assert flash.outs[0].data_ptr() == seen.output[1:].data_ptr()
    if preset == "turboquant_k8v4":  # lossless: float64 attention is the truth
        assert _error(run) < TOL


def test_an_output_of_another_dtype_gets_the_same_values(
    triton_device, flash, monkeypatch
):
    """An output the kernels cannot write (float64 here) still receives the
    attention, by one copy; the values equal the in-place run's."""
    seen = _watch(monkeypatch, flash)
    in_place = _run("turboquant_4bit_nc", triton_device, monkeypatch).out
    assert seen.writes == []
    seen = _watch(monkeypatch, flash, output_dtype=torch.float64)
    copied = _run("turboquant_4bit_nc", triton_device, monkeypatch).out
    assert copied.dtype == torch.float64
    assert len(seen.writes) == 1 and seen.writes[0].startswith("aten.copy_")
    assert torch.equal(copied, in_place.double())


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_real_kernels_write_the_copy_paths_bits_in_place(preset, monkeypatch):
    """bf16 on the GPU, vLLM's FlashAttention and the installed decode: the
    in-place step writes nothing but kernel results into the output, and
    bit for bit what an fp32 output (the copy path) receives."""
    real = turboquant_attn.flash_attn_varlen_func
    seen = _watch(monkeypatch, real)
    in_place = _run(preset, "cuda", monkeypatch, dtype=torch.bfloat16).out
    assert seen.writes == [], f"copies into the layer output: {seen.writes}"
    assert not in_place.isnan().any()
    seen = _watch(monkeypatch, real, output_dtype=torch.float32)
    copied = _run(preset, "cuda", monkeypatch, dtype=torch.bfloat16).out
    assert len(seen.writes) == 1
    assert torch.equal(copied, in_place.float())


def test_output_rows():
    out2d = torch.zeros(6, HQ * D)
    rows = output_rows(out2d, 4, HQ, D, torch.float32)
    assert rows.shape == (4, HQ, D) and rows.data_ptr() == out2d.data_ptr()
    out3d = torch.zeros(6, HQ, D, dtype=torch.bfloat16)
    assert output_rows(out3d, 4, HQ, D, torch.bfloat16).data_ptr() == out3d.data_ptr()
    # Another dtype, or rows with gaps between them: the forward copies.
    assert output_rows(out2d, 4, HQ, D, torch.bfloat16) is None
    assert (
        output_rows(torch.zeros(6, 2 * HQ * D)[:, ::2], 4, HQ, D, torch.float32) is None
    )


def test_place_copies_only_what_is_elsewhere():
    dst = torch.zeros(3, HQ * D)
    place(dst, dst.view(3, HQ, D))  # already there
    assert dst.eq(0).all()
    src = torch.randn(3, HQ, D, dtype=torch.float64)
    place(dst, src)
    assert torch.equal(dst, src.reshape(3, -1).float())
