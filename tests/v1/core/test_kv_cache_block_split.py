# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-cache tensors only attention layers share, shortened to the block
ids attention takes (issue 47's padding with MTP on hybrids).

Qwen3.6-27B with MTP has 17 attention layers (the MTP layer joins the main
model's 16) beside 48 GDN layers: groups of 17, so every GDN block leaves the
17th tensor's page empty. vLLM's planner and `vllm kv-capacity` give that
tensor the pages attention's share of a full cache needs and spend the rest
on block ids for all.
"""

import pytest

from tests.models.tiny_hybrids import prefix_cache_matrix as pcm
from tests.models.tiny_hybrids import prefix_cache_plan
from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.v1.core import kv_cache_capacity as capacity
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_block_split import sized_split, why_not_split

QWEN36 = "Qwen3.6-27B"


@pytest.fixture(scope="module")
def qwen36(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size")
    return str(write_full_size_config(QWEN36, root / QWEN36))


def plan(
    model: str, max_model_len: int, kv_bytes: int, **kw
) -> capacity.CapacityReport:
    report = capacity.plan_capacity(
        capacity.CapacityRequest(
            model=model,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            language_model_only=True,
            usage_context="llm",
            **kw,
        )
    )
    print(capacity.format_report(report))
    assert not report.fails, report.error or report.backend_errors
    return report


def plan_mtp(model: str, kv: str) -> capacity.CapacityReport:
    """16 GiB, 64K tokens, MTP (3 draft tokens), prefix caching in align mode."""
    kv_bytes, max_model_len = prefix_cache_plan.budget(QWEN36)
    return plan(
        model,
        max_model_len,
        kv_bytes,
        kv_cache_dtype=kv,
        num_speculative_tokens=pcm.SPECS["mtp"]["num_speculative_tokens"],
        max_num_batched_tokens=pcm.MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
    )


@pytest.fixture
def unsplit(monkeypatch):
    """0.20.2's layout: every tensor num_blocks pages."""
    monkeypatch.setattr(
        kv_cache_utils, "split_attention_only_tensors", lambda *args: None
    )


@pytest.mark.parametrize(
    "kv, every_group, full_load",
    [("auto", 4.75, 0.55), ("turboquant_4bit_nc", 5.01, 1.79)],
)
def test_unsplit_mtp_padding_weighs_groups_by_the_blocks_a_request_holds(
    qwen36, unsplit, kv, every_group, full_load
):
    """Without the split each GDN group's blocks leave one of 17 page slots
    empty. Counted per group (every group holding as many blocks) that is
    4.75-5.01 %; a 64K request holds 2 + 3 blocks per GDN group (align mode
    keeps two states, and one per MTP draft token) against one attention
    block per 416 or 1,632 tokens, so with the cache full the empty slots
    take 0.55 % and 1.79 %."""
    _, max_model_len = prefix_cache_plan.budget(QWEN36)
    report = plan_mtp(qwen36, kv)
    assert report.padding_layers == 3
    assert report.tensor_pages == {report.num_blocks: 17}
    assert 100 * report.padding_fraction == pytest.approx(every_group, abs=0.01)
    assert 100 * report.padding_fraction_full_load == pytest.approx(full_load, abs=0.01)
    held = {
        ("GDN" if g["type"] == "MambaSpec" else "attention", g["blocks_per_request"])
        for g in report.groups
    }
    assert held == {
        ("GDN", 2 + pcm.SPECS["mtp"]["num_speculative_tokens"]),
        ("attention", -(-max_model_len // report.block_size)),
    }
    text = capacity.format_report(report)
    assert f"{100 * report.padding_fraction_full_load:.2f}% with the cache full" in text


@pytest.mark.parametrize(
    "kv, every_group, gain",
    [("auto", 0.36, 0.0034), ("turboquant_4bit_nc", 0.63, 0.0153)],
)
def test_split_leaves_only_the_page_padding(qwen36, kv, every_group, gain):
    """With the 17th tensor holding only attention's share, what holds no
    data is the GDN page padding (0.36 % bf16, 0.63 % 4bit_nc): under issue
    47's 1 % per group and at full load. The same memory holds 0.34 % and
    1.5 % more KV tokens (2 and 9 more blocks of 593 and 590)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache_utils, "split_attention_only_tensors", lambda *a: None)
        before = plan_mtp(qwen36, kv)
    after = plan_mtp(qwen36, kv)
    assert 100 * after.padding_fraction == pytest.approx(every_group, abs=0.01)
    assert after.padding_fraction_full_load < 0.01
    (short, _), (full, n_full) = sorted(after.tensor_pages.items())
    assert (full, n_full) == (after.num_blocks, 16)
    page = after.page_size_bytes
    assert page * (16 * full + short) <= 17 * page * before.num_blocks
    # Attention's share of a 64K request's blocks, past the null block.
    attention = -(-after.max_model_len // after.block_size)
    share = attention / (attention + 3 * (2 + 3))
    assert short - 1 >= share * after.num_blocks
    assert after.max_concurrency == round(after.num_blocks / (attention + 15), 2)
    assert after.kv_tokens / before.kv_tokens - 1 == pytest.approx(gain, abs=2e-4)
    text = capacity.format_report(after)
    assert (
        f"  KV-cache tensors: 1 of {short:,} pages, 16 of {full:,} pages (block "
        f"ids below {short:,} for the layers on the shorter)"
    ) in text


@pytest.mark.parametrize("kv", ["auto", "turboquant_4bit_nc"])
def test_the_tiny_split_checkpoint_plans_a_short_tensor(tmp_path, kv):
    """The GPU gate's qwen3_5_split cells (6 GDN + 3 attention layers and
    MTP) run the split pool; without MTP their reference has none."""
    from tests.models.tiny_hybrids.checkpoints import write_config

    model = str(write_config("qwen3_5_split", tmp_path / "qwen3_5_split"))

    def tiny(**kw):
        return plan(model, 2048, pcm.KV_CACHE_MEMORY_BYTES, kv_cache_dtype=kv, **kw)

    mtp = tiny(num_speculative_tokens=3)
    assert [g["layers"] for g in mtp.groups] == [3, 3, 4]
    (short, one), (full, four) = sorted(mtp.tensor_pages.items())
    assert (one, full, four) == (1, mtp.num_blocks, 3)
    assert tiny().tensor_pages == {tiny().num_blocks: 3}


def test_without_mtp_no_tensor_is_attention_only(qwen36):
    """48 GDN + 16 attention layers make groups of 16 with no empty slot."""
    kv_bytes, max_model_len = prefix_cache_plan.budget(QWEN36)
    report = plan(qwen36, max_model_len, kv_bytes)
    assert report.tensor_pages == {report.num_blocks: 16}


@pytest.mark.parametrize(
    "num_blocks, tensors, short, attention, total, expected",
    [
        # The 27B shape: 17 tensors, one short; 158 of 173 blocks attention's.
        (593, 17, 1, 158, 173, (595, 545)),
        # Attention holding every block: nothing to gain.
        (593, 17, 1, 10, 10, None),
        # Too few blocks for a short tensor to free a whole block id.
        (4, 17, 1, 158, 173, None),
    ],
)
def test_sized_split(num_blocks, tensors, short, attention, total, expected):
    sized = sized_split(num_blocks, tensors, short, attention, total)
    assert sized == expected
    if sized:
        n, a = sized
        assert (tensors - short) * n + short * a <= tensors * num_blocks
        assert a - 1 >= attention / total * n


class _Config:
    def __init__(self, **kw):
        self.kv_transfer_config = kw.get("kv_transfer_config")
        self.cache_config = type(
            "C", (), {"num_gpu_blocks_override": kw.get("override")}
        )()


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"kv_transfer_config": object()}, "a KV connector or KV offloading"),
        ({"override": 100}, "num_gpu_blocks_override fixes the block count"),
        ({}, None),
    ],
)
def test_options_that_assume_full_tensors_keep_0_20_2s_layout(monkeypatch, kw, reason):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    found = why_not_split(_Config(**kw))
    assert (found is None) if reason is None else found.startswith(reason)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert why_not_split(_Config()) == "the V2 model runner is on"
