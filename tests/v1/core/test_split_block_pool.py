# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block pool split at A: attention groups take block ids below A (their
short tensor has no page past it), Mamba groups take ids from A up first, and
admission holds back a request whose attention blocks do not fit below A."""

import dataclasses
import random

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block_split import mamba_group_ids, split_point
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.split_block_pool import SplitBlockPool, SplitFreeBlockQueue
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = pytest.mark.cpu_test

BLOCK = 16
NUM_BLOCKS = 20
SPLIT = 8
ATTENTION = FullAttentionSpec(
    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
)
PAGE = ATTENTION.page_size_bytes


@pytest.fixture(autouse=True)
def _hash_fn():
    init_none_hash(sha256)


def hybrid_config(split: int | None = SPLIT) -> KVCacheConfig:
    """Three attention layers beside a Mamba group of two: the third tensor
    holds an attention layer only, and ``split`` pages where it is set."""
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((1,),),
        dtypes=(torch.float32,),
        page_size_padded=PAGE,
        mamba_cache_mode="align",
    )
    short = NUM_BLOCKS if split is None else split
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=PAGE * NUM_BLOCKS, shared_by=["a0", "m0"]),
            KVCacheTensor(size=PAGE * NUM_BLOCKS, shared_by=["a1", "m1"]),
            KVCacheTensor(size=PAGE * short, shared_by=["a2"]),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["a0", "a1", "a2"], ATTENTION),
            KVCacheGroupSpec(["m0", "m1"], mamba),
        ],
    )


def manager(config: KVCacheConfig) -> KVCacheManager:
    return KVCacheManager(
        config,
        max_model_len=8 * BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )


def request(request_id: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def schedule(kv: KVCacheManager, req: Request, num_tokens: int | None = None):
    """One scheduler step for ``req``: its hits, then ``num_tokens`` more (the
    rest of the prompt by default)."""
    kv.new_step_starts()
    hits, num_hit_tokens = (
        kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else (None, 0)
    )
    computed = req.num_computed_tokens + num_hit_tokens
    new = (req.num_tokens - computed) if num_tokens is None else num_tokens
    blocks = kv.allocate_slots(req, new, num_hit_tokens, hits)
    if blocks is not None:
        req.num_computed_tokens = computed + new
    return blocks


def ids(blocks) -> tuple[list[int], list[int]]:
    attention, mamba = blocks.get_block_ids()
    return attention, [i for i in mamba if i != 0]


def test_each_range_keeps_its_own_eviction_order():
    pool = SplitBlockPool(NUM_BLOCKS, SPLIT, frozenset({1}), True, BLOCK)
    queue = pool.free_block_queue
    assert isinstance(queue, SplitFreeBlockQueue)
    assert (queue.low.num_free_blocks, queue.high.num_free_blocks) == (7, 12)
    low = pool.get_new_blocks(3)
    assert [b.block_id for b in low] == [1, 2, 3]
    high = pool.get_new_blocks(2, high_first=True)
    assert [b.block_id for b in high] == [8, 9]
    pool.free_blocks([low[2], high[1], low[0]])
    assert [b.block_id for b in queue.low.get_all_free_blocks()] == [
        4,
        5,
        6,
        7,
        3,
        1,
    ]
    assert [b.block_id for b in queue.high.get_all_free_blocks()][-1] == 9
    pool.touch([low[0]])
    assert 1 not in [b.block_id for b in queue.get_all_free_blocks()]
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 3


def test_high_first_falls_back_below_the_split_and_low_never_goes_above():
    pool = SplitBlockPool(NUM_BLOCKS, SPLIT, frozenset({1}), True, BLOCK)
    taken = pool.get_new_blocks(14, high_first=True)
    assert [b.block_id for b in taken] == list(range(8, 20)) + [1, 2]
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 4, 5, 6, 7]
    pool.free_blocks(taken[:12])
    with pytest.raises(ValueError, match="below block id 8: 0 are free there"):
        pool.get_new_blocks(1)


def test_the_coordinator_builds_the_pool_the_config_asks_for():
    assert type(manager(hybrid_config(split=None)).block_pool) is BlockPool
    pool = manager(hybrid_config()).block_pool
    assert isinstance(pool, SplitBlockPool)
    assert (pool.split, pool.high_first_groups) == (SPLIT, frozenset({1}))


def test_attention_below_the_split_mamba_above():
    kv = manager(hybrid_config())
    attention, mamba = ids(schedule(kv, request("r1", list(range(3 * BLOCK)))))
    assert attention == [1, 2, 3]
    assert mamba and min(mamba) >= SPLIT


def test_admission_holds_back_what_does_not_fit_below_the_split():
    """With ids 1..7 all held by attention, a request whose attention block
    would have to go past the split waits though 10 blocks are free; a
    pool without the split would hand it one of them."""
    kv = manager(hybrid_config())
    first = request("r1", list(range(3 * BLOCK)))
    assert schedule(kv, first) is not None
    assert schedule(kv, request("r2", list(range(100, 100 + 4 * BLOCK)))) is not None
    free = kv.block_pool.get_num_free_blocks()
    assert (free, kv.block_pool.get_num_free_low_blocks()) == (10, 0)
    waiting = request("r3", list(range(200, 200 + BLOCK)))
    assert schedule(kv, waiting) is None
    assert not kv.can_fit_full_sequence(waiting)

    plain = manager(hybrid_config(split=None))
    schedule(plain, request("r1", list(range(3 * BLOCK))))
    schedule(plain, request("r2", list(range(100, 100 + 4 * BLOCK))))
    attention, _ = ids(schedule(plain, request("r3", list(range(200, 200 + BLOCK)))))
    assert attention[0] >= SPLIT

    kv.free(first)
    attention, mamba = ids(schedule(kv, waiting))
    assert max(attention) < SPLIT
    assert min(mamba) >= SPLIT


def test_a_hit_reuses_cached_blocks_of_both_ranges():
    kv = manager(hybrid_config())
    prompt = list(range(4 * BLOCK)) + [7]
    cold = request("cold", prompt)
    # Align mode keeps a Mamba state where a step ends on a block boundary.
    schedule(kv, cold, 4 * BLOCK)
    schedule(kv, cold)
    cold_attention, cold_mamba = ids(kv.get_blocks("cold"))
    kv.free(cold)
    hit = request("hit", prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(hit)
    assert num_hit_tokens == 4 * BLOCK
    assert schedule(kv, hit) is not None
    attention, mamba = ids(kv.get_blocks("hit"))
    assert attention[:4] == cold_attention[:4]
    assert max(attention) < SPLIT
    assert set(mamba) & set(cold_mamba)


def planned_scheduler(model: str, kv: str, blocks_of_pages: int):
    """The engine's scheduler for ``model`` with MTP (3 draft tokens) and
    prefix caching in align mode, on KV memory of ``blocks_of_pages`` pages
    of every layer slot, planned as the engine plans it (on this host)."""
    from tests.models.tiny_hybrids.prefix_cache_plan import planned_kv_cache_config
    from vllm.v1.core import kv_cache_capacity as capacity

    req = capacity.CapacityRequest(
        model=model,
        max_model_len=2048,
        kv_cache_dtype=kv,
        num_speculative_tokens=3,
        language_model_only=True,
        kv_cache_memory_bytes=2**30,  # for the page size; sized below
        max_num_batched_tokens=512,
        usage_context="llm",
        enable_prefix_caching=True,
        mamba_cache_mode="align",
    )
    vllm_config, config = planned_kv_cache_config(req)
    page = max(g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups)
    slots = 4  # 3 attention layers and MTP's beside GDN groups of 3
    req = dataclasses.replace(req, kv_cache_memory_bytes=page * slots * blocks_of_pages)
    vllm_config, config = planned_kv_cache_config(req)
    vllm_config.scheduler_config.async_scheduling = False
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.kv_cache_groups[0].kv_cache_spec.block_size,
        log_stats=True,
    )
    return scheduler, config


def serve_until_done(scheduler: Scheduler, config: KVCacheConfig, seed: int = 0):
    """Ten requests on a shared 700-token prefix, 300 tokens each, MTP drafts
    accepted at random; returns the requests and the first attention block
    id found at or past the split, if any."""
    from tests.models.tiny_hybrids.preemption_sim import step

    rng = random.Random(seed)
    split = split_point(config)
    mamba = mamba_group_ids(config.kv_cache_groups)
    hasher = get_request_block_hasher(scheduler.block_size, sha256)
    prefix = [rng.randrange(1000) for _ in range(700)]
    reqs = []
    for i in range(10):
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        tokens = prefix + [rng.randrange(1000) for _ in range(rng.randrange(50, 900))]
        reqs.append(Request(f"r{i}", tokens, params, None, block_hasher=hasher))
        scheduler.add_request(reqs[-1])
    past_split = []

    def seen(out):
        for rid in out.num_scheduled_tokens:
            ids = scheduler.kv_cache_manager.get_block_ids(rid)
            for group, blocks in enumerate(ids):
                if group not in mamba:
                    past_split.extend(b for b in blocks if b >= split)

    while not all(r.is_finished() for r in reqs):
        step(scheduler, rng, 3, seen)
    return reqs, past_split[0] if past_split else None


@pytest.mark.parametrize("kv", ["auto", "turboquant_4bit_nc"])
def test_the_scheduler_preempts_and_finishes_with_attention_below_the_split(
    tmp_path, monkeypatch, kv
):
    """vLLM's scheduler with MTP, prefix caching and preemption, on the GPU
    gate's qwen3_5_split checkpoint planned at about two max-length
    requests: every request finishes, attention never holds an id past the
    split, and every block is free again at the end. The same config on
    0.20.2's pool hands attention ids past the split (its short tensor's
    pages end there)."""
    from tests.models.tiny_hybrids.checkpoints import write_config

    model = str(write_config("qwen3_5_split", tmp_path / "qwen3_5_split"))
    scheduler, config = planned_scheduler(model, kv, blocks_of_pages=60)
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, SplitBlockPool)
    reqs, past_split = serve_until_done(scheduler, config)
    assert past_split is None
    assert [len(r.output_token_ids) for r in reqs] == [300] * 10
    assert sum(r.num_preemptions for r in reqs) > 0
    assert pool.get_num_free_blocks() == config.num_blocks - 1

    def plain_pool(config, *args):
        return BlockPool(config.num_blocks, *args)

    monkeypatch.setattr(kv_cache_coordinator, "make_block_pool", plain_pool)
    scheduler, config = planned_scheduler(model, kv, blocks_of_pages=60)
    _, past_split = serve_until_done(scheduler, config)
    assert past_split is not None and past_split >= split_point(config)
