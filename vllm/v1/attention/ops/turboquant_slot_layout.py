# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the fields of a packed TurboQuant K/V slot lie, for the kernels.

A slot holds one token's key and value for one KV head, in this order:
the key field (FP8 keys: one byte per dimension; MSE keys: the centroid
indices, then the key norm as fp16) and the value field (the value indices,
then the fp16 scale and zero). ``TurboQuantConfig`` sizes the two fields for
the cache allocation; the store, the decode stages and the prefill
dequantization also need where each part starts, and read the cache in words
where its strides allow. Both are computed here, once.
"""

import functools
import math
from dataclasses import dataclass

import torch

# Bytes of each fp16 scalar of a slot: the key norm, the value scale and zero.
_FP16_BYTES = 2


@dataclass(frozen=True)
class SlotLayout:
    """The byte offsets inside one packed slot."""

    head_dim: int
    key_fp8: bool
    # Index bits of an MSE key dimension (0 for FP8 keys).
    key_bits: int
    value_bits: int

    @property
    def key_index_bytes(self) -> int:
        """Bytes of an MSE key's centroid indices; its norm follows them."""
        return 0 if self.key_fp8 else math.ceil(self.head_dim * self.key_bits / 8)

    @property
    def key_bytes(self) -> int:
        """The key field (``TurboQuantConfig.key_packed_size``); the value
        field starts here."""
        if self.key_fp8:
            return self.head_dim
        return self.key_index_bytes + _FP16_BYTES

    @property
    def value_index_bytes(self) -> int:
        """Bytes of the value indices; the scale and the zero follow them."""
        return math.ceil(self.head_dim * self.value_bits / 8)

    @property
    def value_bytes(self) -> int:
        """The value field (``TurboQuantConfig.value_packed_size``)."""
        return self.value_index_bytes + 2 * _FP16_BYTES

    @property
    def slot_bytes(self) -> int:
        return self.key_bytes + self.value_bytes


@functools.cache
def slot_layout(
    head_dim: int, key_fp8: bool, mse_bits: int, value_bits: int
) -> SlotLayout:
    """The layout of a slot, from the arguments the backend's kernels take
    (``mse_bits`` is not read for FP8 keys: the config sets it to the value
    bits there)."""
    key_fp8 = bool(key_fp8)
    return SlotLayout(head_dim, key_fp8, 0 if key_fp8 else mse_bits, value_bits)


def config_slot_layout(cfg) -> SlotLayout:
    """The layout of a ``TurboQuantConfig``'s slots."""
    return slot_layout(
        cfg.head_dim, cfg.key_fp8, cfg.key_mse_bits, cfg.effective_value_quant_bits
    )


def check_cache_slots(kv_cache: torch.Tensor, layout: SlotLayout) -> None:
    """Refuse a cache whose slots are not ``layout``'s (their size rounded up
    to even, as ``TurboQuantConfig.slot_size_aligned``): a layer reading a
    cache shaped for another preset would read and write the wrong bytes."""
    want = layout.slot_bytes + layout.slot_bytes % 2
    if kv_cache.shape[-1] != want:
        keys = "FP8" if layout.key_fp8 else f"{layout.key_bits}-bit"
        raise ValueError(
            f"the KV cache's slots are {kv_cache.shape[-1]} bytes, but this layer "
            f"({keys} keys, {layout.value_bits}-bit values, head_dim "
            f"{layout.head_dim}) stores {want}-byte slots: its cache was shaped "
            "for another TurboQuant preset. Shape each layer's cache from its own "
            "KV dtype (the attention layer's kv_cache_dtype)."
        )


def words_aligned(kv_cache: torch.Tensor, width: int = 2) -> bool:
    """Whether every packed field of every slot starts at a multiple of
    ``width`` bytes, so the cache can be read as ``width``-byte words.

    Field offsets inside a slot are even; an odd page, token or head stride
    (a page padded to an odd size) or an odd base address breaks that, and a
    kernel must load bytes. Only FP8-key slots are also whole 4-byte words.
    """
    return (
        kv_cache.data_ptr() % width == 0
        and kv_cache.shape[-1] % width == 0
        and all(st % width == 0 for st in kv_cache.stride()[:-1])
    )


def stage1_strides(
    q_in: torch.Tensor,
    kv_cache: torch.Tensor,
    unit: int,
    block_table: torch.Tensor,
    out: torch.Tensor,
    mid: torch.Tensor,
) -> tuple[int, ...]:
    """The strides both decode stage-1 kernels take, in their order: query,
    cache (in load units of ``unit`` bytes), block table, output, scratch
    (``mid`` is ``out`` when there is one split; its split stride is then
    unused)."""
    st = kv_cache.stride()
    return (
        q_in.stride(0),
        q_in.stride(1),
        st[0] // unit,
        st[1] // unit,
        st[2] // unit,
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2) if mid.dim() == 4 else 0,
    )


def check_key_offset(key_offset: torch.Tensor, num_kv_heads: int, head_dim: int):
    """A key offset the kernels can read: [num_kv_heads, head_dim] fp32,
    contiguous."""
    if (
        key_offset.dtype != torch.float32
        or key_offset.shape != (num_kv_heads, head_dim)
        or not key_offset.is_contiguous()
    ):
        raise ValueError(
            f"key_offset must be a contiguous [{num_kv_heads}, {head_dim}] float32 "
            f"tensor (KV heads x head_dim), got {key_offset.dtype} "
            f"{tuple(key_offset.shape)}; bind it with turboquant.key_offset"
        )
