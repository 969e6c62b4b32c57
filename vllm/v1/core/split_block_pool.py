# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A block pool whose ids are split at A for tensors shorter than the others
(``kv_cache_block_split``).

Ids ``[1, A)`` and ``[A, num_blocks)`` sit in two free queues, each in its own
eviction order. Attention groups allocate below A only: their layers' short
tensors have no page past it, and the block zeroer writes every attention
group's new ids into every full-attention tensor. Mamba groups allocate from
A up first and fall back below A. The null block, the zero-filled block tables
of CUDA graphs and the prefix cache's ``(hash, group)`` map all stay as they
are, because there is still one id space.
"""

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block_split import mamba_group_ids, split_point
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig


class SplitFreeBlockQueue:
    """The free queue of ``BlockPool``, as one queue per id range.

    ``popleft_n`` takes from below the split unless ``high_first`` is set, so
    a caller that does not know about the split (the sink manager takes its
    blocks straight from the queue) gets ids every tensor has.
    """

    def __init__(self, blocks: list[KVCacheBlock], split: int) -> None:
        self.split = split
        self.low = FreeKVCacheBlockQueue([b for b in blocks if b.block_id < split])
        self.high = FreeKVCacheBlockQueue([b for b in blocks if b.block_id >= split])
        self.high_first = False

    @property
    def num_free_blocks(self) -> int:
        return self.low.num_free_blocks + self.high.num_free_blocks

    def _queue(self, block: KVCacheBlock) -> FreeKVCacheBlockQueue:
        return self.low if block.block_id < self.split else self.high

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not self.high_first:
            if n > self.low.num_free_blocks:
                raise ValueError(
                    f"Cannot get {n} free blocks below block id {self.split}: "
                    f"{self.low.num_free_blocks} are free there. Admission "
                    "(SplitBlockPool.num_blocks_to_allocate) should have held "
                    "this request back; please report it with the model and "
                    "--speculative-config used."
                )
            return self.low.popleft_n(n)
        from_high = min(n, self.high.num_free_blocks)
        return self.high.popleft_n(from_high) + self.low.popleft_n(n - from_high)

    def remove(self, block: KVCacheBlock) -> None:
        self._queue(block).remove(block)

    def append(self, block: KVCacheBlock) -> None:
        self._queue(block).append(block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        self.low.append_n([b for b in blocks if b.block_id < self.split])
        self.high.append_n([b for b in blocks if b.block_id >= self.split])

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return self.low.get_all_free_blocks() + self.high.get_all_free_blocks()


class SplitBlockPool(BlockPool):
    """``BlockPool`` over a ``SplitFreeBlockQueue``; ``high_first_groups`` are
    the KV-cache groups (Mamba) that may hold ids at or above ``split``."""

    def __init__(
        self,
        num_gpu_blocks: int,
        split: int,
        high_first_groups: frozenset[int],
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ):
        super().__init__(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
        )
        self.split = split
        self.high_first_groups = high_first_groups
        # The base class has taken block 0 as the null block; the rest are free.
        self.free_block_queue = SplitFreeBlockQueue(self.blocks[1:], split)

    def get_new_blocks(
        self, num_blocks: int, high_first: bool = False
    ) -> list[KVCacheBlock]:
        self.free_block_queue.high_first = high_first
        try:
            return super().get_new_blocks(num_blocks)
        finally:
            self.free_block_queue.high_first = False

    def get_num_free_low_blocks(self) -> int:
        return self.free_block_queue.low.num_free_blocks

    def num_blocks_to_allocate(
        self,
        demands: Sequence[int],
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
    ) -> int:
        """The coordinator's total, or ``num_gpu_blocks + 1`` ("does not fit")
        where the ids below the split cannot take what must go there.

        Below the split go every block the attention groups take (new ones and
        cache hits waiting in the free queue) and the Mamba groups' hits that
        wait there. Mamba's new blocks take the high range first, so what they
        take below the split is their demand past the high range's free
        blocks, which the caller's check of the total against all free blocks
        keeps within what attention leaves: together the two checks hold in
        any order the groups allocate in.
        """
        low = 0
        for group_id, demand in enumerate(demands):
            if group_id not in self.high_first_groups:
                low += demand
                continue
            low += sum(
                1
                for b in new_computed_blocks[group_id]
                if b.ref_cnt == 0 and not b.is_null and b.block_id < self.split
            )
        if low > self.get_num_free_low_blocks():
            return self.num_gpu_blocks + 1
        return sum(demands)


class _HighFirst:
    """A Mamba group's view of a ``SplitBlockPool``: new blocks from the high
    range first; everything else is the pool's."""

    def __init__(self, pool: SplitBlockPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return self._pool.get_new_blocks(num_blocks, high_first=True)


def make_block_pool(
    kv_cache_config: KVCacheConfig,
    enable_caching: bool,
    hash_block_size: int,
    enable_kv_cache_events: bool,
    metrics_collector: KVCacheMetricsCollector | None,
) -> BlockPool:
    """The coordinator's pool: split where ``kv_cache_config`` is."""
    split = split_point(kv_cache_config)
    if split is None:
        return BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
        )
    return SplitBlockPool(
        kv_cache_config.num_blocks,
        split,
        mamba_group_ids(kv_cache_config.kv_cache_groups),
        enable_caching,
        hash_block_size,
        enable_kv_cache_events,
        metrics_collector,
    )


def pool_for_group(pool: BlockPool, group_id: int) -> BlockPool:
    """The pool a group's manager allocates from."""
    if isinstance(pool, SplitBlockPool) and group_id in pool.high_first_groups:
        return _HighFirst(pool)  # type: ignore[return-value]
    return pool


def num_blocks_to_allocate(
    pool: BlockPool,
    demands: Sequence[int],
    new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
) -> int:
    """What the coordinator reports for the groups' ``demands``."""
    if isinstance(pool, SplitBlockPool):
        return pool.num_blocks_to_allocate(demands, new_computed_blocks)
    return sum(demands)
