# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Padded attention pages in the runner (patch 0004).

- A padded page is never split into kernel blocks: kernel block ``j`` of page
  ``i`` would be addressed as ``i * blocks_per_page + j`` with the unpadded
  stride and run into the padding. Pristine 0.20.2 splits it silently.
- The view of a padded cache keeps each block's data inside its own page for
  block-first layouts (TurboQuant, Triton) and for FlashAttention's
  ``(2, num_blocks, ...)``, where pristine's padded branch strided the K/V
  dimension by the page instead.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.utils import prepare_kernel_block_sizes

pytestmark = pytest.mark.cpu_test


class _SmallKernelBlocks:
    """A backend whose kernels take 16-64 token blocks only (TurboQuant 0.20.2)."""

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [16, 32, 64]

    @staticmethod
    def get_name():
        return "SMALL_BLOCKS"


class _AnyMultipleOf16:
    @staticmethod
    def get_supported_kernel_block_sizes():
        return [MultipleOf(16)]

    @staticmethod
    def get_name():
        return "ANY_16"


def _config(spec):
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(size=4 * spec.page_size_bytes, shared_by=["l0"])
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


def _padded(block_size=96):
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        page_size_padded=spec.page_size_bytes + 4096,
    )


def test_padded_page_is_not_split_into_kernel_blocks():
    spec = _padded()
    groups = [[SimpleNamespace(backend=_SmallKernelBlocks)]]
    with pytest.raises(
        ValueError, match=r"padded pages .*SMALL_BLOCKS.*kernel blocks of 32 tokens"
    ):
        prepare_kernel_block_sizes(_config(spec), groups)


def test_padded_page_is_one_kernel_block_when_the_backend_allows():
    spec = _padded()
    groups = [[SimpleNamespace(backend=_AnyMultipleOf16)]]
    assert prepare_kernel_block_sizes(_config(spec), groups) == [spec.block_size]


@pytest.mark.parametrize(
    "shape, block_dim",
    [
        ((2, 3, 16, 2, 8), 1),  # FlashAttention: (2, num_blocks, block, heads, dim)
        ((3, 2, 16, 2, 8), 0),  # Triton attention: (num_blocks, 2, ...)
        ((3, 16, 2, 24), 0),  # TurboQuant: (num_blocks, block, heads, slot)
    ],
)
def test_padded_view_keeps_each_block_inside_its_page(shape, block_dim):
    from vllm.v1.worker.kv_cache_padded_views import padded_page_view

    num_blocks = shape[block_dim]
    real = torch.Size(shape).numel() // num_blocks
    page = real + 40
    raw = torch.full((num_blocks * page,), -1.0)
    view = padded_page_view(raw, shape, block_dim, page)
    view.copy_(torch.arange(view.numel(), dtype=raw.dtype).view(shape))
    pages = raw.view(num_blocks, page)
    assert (pages[:, real:] == -1).all(), "data written into padding"
    for b in range(num_blocks):
        block = view.select(block_dim, b)
        assert torch.equal(pages[b, :real].sort().values, block.flatten().sort().values)


@pytest.mark.gpu
def test_flash_attention_reads_a_padded_cache_like_a_contiguous_one():
    """FlashAttention over the padded view gives the contiguous cache's result."""
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_flash_attn_version,
    )
    from vllm.v1.worker.kv_cache_padded_views import padded_page_view

    torch.manual_seed(0)
    num_blocks, block, heads, dim, q_heads = 8, 32, 2, 128, 8
    shape = (2, num_blocks, block, heads, dim)
    real = 2 * block * heads * dim
    page = real + 1024
    raw = torch.zeros(num_blocks * page, dtype=torch.bfloat16, device="cuda")
    padded = padded_page_view(raw, shape, 1, page)
    padded.copy_(torch.randn(shape, dtype=torch.bfloat16, device="cuda"))
    contiguous = padded.contiguous()
    seq_lens = torch.tensor([70, 200], dtype=torch.int32, device="cuda")
    block_table = torch.tensor(
        [[5, 1, 7, 0, 0, 0, 0], [2, 4, 6, 3, 0, 1, 7]], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(
        2, q_heads, dim, dtype=torch.bfloat16, device="cuda"
    )  # one decode token each
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    outs = []
    for kv in (padded, contiguous):
        k, v = kv.unbind(0)
        outs.append(
            flash_attn_varlen_func(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_q,
                max_seqlen_q=1,
                seqused_k=seq_lens,
                max_seqlen_k=200,
                softmax_scale=dim**-0.5,
                causal=True,
                block_table=block_table,
                # The version the FlashAttention backend runs on this GPU (FA3
                # on Hopper). The interface's default is FA2, whose library
                # holds sm_80 code only: on Hopper the driver compiles its
                # kernels from PTX at their first launch.
                fa_version=get_flash_attn_version(head_size=dim),
            )
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _layout_runner(groups, layer_dtypes=None):
    """The runner state ``_reshape_kv_cache_tensors`` reads: attention groups
    of ``(layer, spec, backend)``, one KV-cache group each; ``layer_dtypes``
    the layers' own KV dtypes (their ``Attention.kv_cache_dtype``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    layers = {
        name: SimpleNamespace(kv_cache_dtype=dtype)
        for name, dtype in (layer_dtypes or {}).items()
    }
    runner = SimpleNamespace(
        runner_only_attn_layers=set(),
        cache_config=SimpleNamespace(cache_dtype="turboquant_4bit_nc"),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        attn_groups=[
            [
                SimpleNamespace(
                    backend=backend,
                    layer_names=[layer],
                    kv_cache_spec=spec,
                    kv_cache_group_id=i,
                )
            ]
            for i, (layer, spec, backend) in enumerate(groups)
        ],
    )
    for name in (
        "_kv_cache_spec_attn_group_iterator",
        "_update_hybrid_attention_mamba_layout",
    ):
        setattr(runner, name, getattr(GPUModelRunner, name).__get__(runner))
    return runner


def test_groups_sharing_a_buffer_never_share_bytes_of_different_blocks():
    """Gemma 3/4 under TurboQuant: sliding-window layers stay bf16
    (FlashAttention, ``(2, num_blocks, ...)``) and share each KV-cache buffer
    with a TurboQuant full-attention layer (``(num_blocks, block, heads,
    slot)``, its page padded). The block pool hands block ids to either group,
    so block ``i`` of one layer must not hold any byte of block ``j != i`` of
    the other. Unless both are laid out per block, FlashAttention's K of
    blocks 2i and 2i + 1 is TurboQuant's block i: on a GPU the first request
    of a fresh engine (the lowest block ids, in use by both groups at once)
    read keys the sliding layers had overwritten, and its prompt
    log-probabilities differed from every later run of the same prompt."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import (
        TurboQuantAttentionBackend,
    )
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, TQFullAttentionSpec

    # The tiny Gemma 3 of tests/models/tiny_hybrids/cache_garbage_check.py:
    # head_dim 256, one KV head, pages unified to 81,920 B.
    sliding = SlidingWindowSpec(
        block_size=80,
        num_kv_heads=1,
        head_size=256,
        dtype=torch.bfloat16,
        sliding_window=64,
    )
    slot = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 256)
    full = TQFullAttentionSpec(
        block_size=304,
        num_kv_heads=1,
        head_size=256,
        head_size_v=256,
        dtype=torch.uint8,
        tq_slot_size=slot.slot_size_aligned,
        page_size_padded=sliding.page_size_bytes,
    )
    assert full.page_size_bytes == sliding.page_size_bytes
    num_blocks = 8
    raw = torch.zeros(num_blocks * sliding.page_size_bytes, dtype=torch.int8)
    runner = _layout_runner(
        [
            ("sliding", sliding, FlashAttentionBackend),
            ("full", full, TurboQuantAttentionBackend),
        ]
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    with set_current_vllm_config(VllmConfig()):
        caches = GPUModelRunner._reshape_kv_cache_tensors(
            runner, {"sliding": raw, "full": raw}, [80, 304]
        )
    kv_sliding, kv_full = caches["sliding"], caches["full"]
    shared = []
    for i in range(num_blocks):
        raw.zero_()
        kv_sliding[:, i].fill_(1.0)  # K and V of sliding block i: bytes 0x3F80
        for j in range(num_blocks):
            if j != i and kv_full[j].any():
                shared.append((i, j))
    assert not shared, (
        f"(sliding block, TurboQuant block) pairs sharing bytes of one buffer: {shared}"
    )
