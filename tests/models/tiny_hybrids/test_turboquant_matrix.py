# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of turboquant_matrix.py: what each row is compared against,
and that every comparison can fail."""

import json

import pytest

from . import turboquant_matrix as tqm

pytestmark = pytest.mark.cpu_test

OUT = [[(p * 7 + t) % 2048 for t in range(tqm.NEW_TOKENS)] for p in range(3)]
CKPTS = {n: f"/c/{n}" for n in ("qwen3_5", "qwen3_next", "qwen3_5_16", "draft_padded")}


def _rec(outs=OUT, rc=0, kv_tokens=1000):
    return {"rc": rc, "outputs": outs, "kv_tokens": kv_tokens, "seconds": 1.0}


def _changed(*at):
    outs = [list(o) for o in OUT]
    for p, t in zip(at[::2], at[1::2]):
        outs[p][t] = (outs[p][t] + 1) % 2048
    return outs


def _gapped(*ties):
    """A reference whose top-1/top-2 gap is 1.0 except at the (p, t) ties."""
    gaps = [[1.0] * tqm.NEW_TOKENS for _ in OUT]
    for p, t in ties:
        gaps[p][t] = 0.001
    return {**_rec(), "gaps": gaps}


def test_configs_and_engine_kwargs():
    cfgs = tqm.configs()
    # The grid, 9 padded-page and draft cells, the pair code with and without MTP.
    assert len(cfgs) == 2 * 2 * len(tqm.PRESETS) + 9 + 2
    pair = [c.name for c in cfgs if c.kv == "turboquant_3bit_pair_nc"]
    assert pair == [
        "qwen3_5.turboquant_3bit_pair_nc.none",
        "qwen3_5.turboquant_3bit_pair_nc.mtp",
    ]
    assert len({c.name for c in cfgs}) == len(cfgs)
    for c in cfgs:
        kw = tqm.engine_kwargs(c, CKPTS)
        json.dumps(kw)
        assert "load_format" not in kw  # saved checkpoints, not dummy weights
        assert kw["enforce_eager"] and kw["kv_cache_dtype"] == c.kv
    mtp = tqm.engine_kwargs(tqm.Config("qwen3_5", "auto", "mtp"), CKPTS)
    assert mtp["speculative_config"]["method"] == "mtp" and mtp["language_model_only"]
    draft = tqm.engine_kwargs(tqm.Config("qwen3_next", "auto", "draft"), CKPTS)
    assert draft["speculative_config"]["model"] == CKPTS["draft_padded"]
    skip = tqm.Config("qwen3_5_16", "turboquant_4bit_nc", "mtp", ("boundary:1",))
    assert tqm.engine_kwargs(skip, CKPTS)["kv_cache_dtype_skip_layers"] == [
        "boundary:1"
    ]


@pytest.mark.parametrize(
    "cfg, rec, others, hf, ok, against, why",
    [
        # auto vs transformers fp32
        (tqm.Config("qwen3_next", "auto"), _rec(), {}, OUT, True, "hf-fp32", ""),
        (tqm.Config("qwen3_next", "auto"), _rec(_changed(1, 9)), {}, OUT, False,
         "hf-fp32", "(1, 9)"),
        # speculation vs the same preset without it
        (tqm.Config("qwen3_5", "turboquant_4bit_nc", "mtp"), _rec(_changed(2, 0)),
         {"qwen3_5.turboquant_4bit_nc.none": _rec()}, None, False,
         "turboquant_4bit_nc no-spec", "(2, 0)"),
        (tqm.Config("qwen3_5", "turboquant_4bit_nc", "mtp"), _rec(),
         {"qwen3_5.turboquant_4bit_nc.none": _rec()}, None, True,
         "turboquant_4bit_nc no-spec", ""),
        # ... where a first difference is a near-tie of the reference, it
        # passes; a difference beside it that is not fails the row
        (tqm.Config("qwen3_next", "turboquant_3bit_nc", "mtp"), _rec(_changed(2, 5)),
         {"qwen3_next.turboquant_3bit_nc.none": _gapped((2, 5))}, None, True,
         "turboquant_3bit_nc no-spec", ""),
        (tqm.Config("qwen3_next", "turboquant_3bit_nc", "mtp"),
         _rec(_changed(0, 9, 2, 5)),
         {"qwen3_next.turboquant_3bit_nc.none": _gapped((2, 5))}, None, False,
         "turboquant_3bit_nc no-spec", "(0, 9)"),
        (tqm.Config("qwen3_next", "turboquant_3bit_nc", "mtp"),
         _rec(_changed(1, 0, 2, 6)),
         {"qwen3_next.turboquant_3bit_nc.none": _gapped((1, 0), (2, 5))}, None, False,
         "turboquant_3bit_nc no-spec", "(2, 6)"),
        (tqm.Config("qwen3_next", "turboquant_3bit_nc", "mtp"), _rec(_changed(2, 6)),
         {"qwen3_next.turboquant_3bit_nc.none": _gapped((2, 5))}, None, False,
         "turboquant_3bit_nc no-spec", "(2, 6)"),
        # TurboQuant vs auto: agreement floor
        (tqm.Config("qwen3_5", "turboquant_k8v4"), _rec([o[:32] + o[:32] for o in OUT]),
         {"qwen3_5.auto.none": _rec()}, None, False, "auto", "agrees with auto"),
        # blind (one token repeated), crash
        (tqm.Config("qwen3_5", "auto", "mtp"), _rec([[5] * 64] * 3),
         {"qwen3_5.auto.none": _rec([[5] * 64] * 3)}, None, False,
         "auto no-spec", "blind"),
        (tqm.Config("qwen3_5", "auto"), _rec(None, rc=1), {}, OUT, False, "-", "rc=1"),
    ],
)  # fmt: skip
def test_check_can_fail(cfg, rec, others, hf, ok, against, why):
    row = tqm.check(cfg, {"name": cfg.name, **rec}, others, {cfg.model: hf})
    assert row["ok"] is ok, row
    assert row["against"] == against and why in row["why"]
    assert ("tie" in row) is (ok and "(2, 5)" in row.get("tie", "")), row


def test_checkpoint_variants_build(tmp_path):
    """The padded-page variants are real checkpoints: 16 layers with the MTP
    layer, and a 6-KV-head draft on qwen3_next's chain."""
    import torch
    from safetensors.torch import load_file, save_file

    from . import checkpoints as ck
    from .builders import TINY_HIDDEN_SIZE

    main = tmp_path / "main"  # stands in for qwen3_next: only its head is read
    main.mkdir()
    head = torch.randn(ck.TINY_VOCAB_SIZE, TINY_HIDDEN_SIZE).to(torch.bfloat16)
    save_file({"lm_head.weight": head}, str(main / "model.safetensors"))
    base, spec = tqm.VARIANTS["draft_padded"]
    draft = ck.build_checkpoint(base, tmp_path / "d", spec=spec, share_from=main)
    cfg = json.loads((draft / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (2, 6)
    w = load_file(next(draft.glob("*.safetensors")))
    assert torch.equal(w["lm_head.weight"], head)
    base, spec = tqm.VARIANTS["qwen3_5_16"]
    assert spec.builder_kwargs["num_layers"] == 16 and spec.mtp


def test_qwen3_5_16_is_not_blind(tmp_path):
    """transformers' fp32 greedy decode of the 16-layer variant on the matrix
    prompts: >= MIN_DISTINCT distinct tokens in every prompt, top-1/top-2 gaps
    >= checkpoints.MIN_GAP (so fp16 on the GPU can equal it token for token),
    and the bigram chain followed (MTP drafts get accepted). At qwen3_5's
    bigram_gain (0.0575) the residual stream of 16 random layers swamps the
    bigram path: 6 distinct tokens on prompt 7, gaps of 6e-5 logits."""
    import torch

    from . import checkpoints as ck

    base, spec = tqm.VARIANTS["qwen3_5_16"]
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    try:
        path = ck.build_checkpoint(base, tmp_path / "qwen3_5_16", spec=spec)
        stats = ck.greedy_stats(
            path, ck.bigram_prompts(12), tqm.NEW_TOKENS, kernel_order_check=False
        )
    finally:
        torch.set_num_threads(threads)
    stats.pop("outputs")
    print(stats)
    assert min(stats["distinct"]) >= tqm.MIN_DISTINCT, stats["distinct"]
    assert stats["min_gap"] >= ck.MIN_GAP, stats
    assert stats["bigram_follow"] >= 0.9, stats
