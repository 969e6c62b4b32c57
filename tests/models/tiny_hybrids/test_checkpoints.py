# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU: the saved tiny checkpoints can fail a token-for-token check.

Each checkpoint of checkpoints.py is built, run greedily in transformers
(fp32 compute on the saved bf16 weights), and must

* vary: >= 16 distinct tokens in 64 for every prompt;
* follow its bigram chain at most positions (drafts get accepted), while
  the history moves the logits (attention/GDN matter; they decide ~0.1-3 %
  of tokens over the matrix prompts, the GPU table's ``ctx`` column);
* keep a top-1/top-2 logit gap of at least MIN_REL_MARGIN logit standard
  deviations on a chain prompt; on the matrix prompts where context decides
  tokens, keep an absolute gap >= checkpoints.MIN_GAP (the prompt screen),
  flip no token between float16 incremental decode and a float16
  full-sequence forward (kernel order alone; the GPU checks run float16) and
  stay on the fp32 trajectory;
* load completely into vLLM's own model classes (and the MTP drafter's):
  every parameter is initialised from the checkpoint, so vLLM runs the same
  weights transformers does. The classes are built on the meta device.
"""

import glob

import pytest
import torch

from . import checkpoints as ck

pytestmark = pytest.mark.cpu_test

# On this prompt every model keeps a top-1/top-2 gap >= 0.58 logit std
# (median 3.5-11). Over all 12 matrix prompts x 64 tokens the smallest gaps
# are 0.0036 (qwen3_dense), 0.019 (qwen3_next), 0.055 (qwen3_5) std, at the
# few context-decided tokens; `python -m tests.models.tiny_hybrids.checkpoints
# OUT` prints those statistics.
MIN_REL_MARGIN = 0.1
MIN_DISTINCT = 16
PROMPTS = ck.bigram_prompts(12)[1:2]  # a chain prompt: drafts get accepted
# The screened prompt where context decides the most tokens (4) at gaps
# down to 0.014 logits (fp32): what rounding would flip first. float16 on
# the CPU is slow; all 12 prompts x 3 targets at fp32:
# ``python -m tests.models.tiny_hybrids.checkpoints OUT --screen`` (~2 min).
CTX_PROMPTS = [ck.candidate_prompts(ck.POOL)[44]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    # Tiny matmuls: more threads only contend on a shared CI box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield ck.build_all(tmp_path_factory.mktemp("tiny_ckpts"))
    finally:
        torch.set_num_threads(threads)


def test_successor_map_is_one_cycle():
    succ = ck.successor_map()
    seen, x = set(), 0
    while x not in seen:
        seen.add(x)
        x = succ[x]
    assert len(seen) == len(succ) == ck.TINY_VOCAB_SIZE


def test_unfuse_experts():
    gate_up = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3)  # E=2, I=3, H=3
    down = torch.arange(2 * 3 * 3.0).reshape(2, 3, 3)
    out = ck._unfuse_experts(
        {
            "model.layers.0.mlp.experts.gate_up_proj": gate_up,
            "model.layers.0.mlp.experts.down_proj": down,
            "model.norm.weight": torch.ones(3),
        }
    )
    p = "model.layers.0.mlp.experts."
    assert torch.equal(out[p + "1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out[p + "1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out[p + "0.down_proj.weight"], down[0])
    assert len(out) == 2 * 3 + 1


def test_prompts():
    prompts = ck.bigram_prompts(12)
    assert len(prompts) == 12
    pool = ck.candidate_prompts(ck.POOL)
    assert prompts == [pool[i] for i in ck.SCREENED]
    assert all(i in ck.SCREENED for i in (5, 44))
    # Random bytes, chain stretches and repetitive text are all there.
    assert {i % 3 for i in ck.SCREENED} == {0, 1, 2}
    assert len(ck.bigram_prompts(14)) == 14
    # Chain prompts repeat a stretch: ngram can draft from them.
    chain = prompts[1]
    assert chain[16:] == chain[:10]
    assert ck.bigram_prompts(12) == prompts


@pytest.mark.parametrize("name", list(ck.MODELS))
def test_greedy_output_depends_on_context_with_margins(built, name):
    torch.set_num_threads(1)
    stats = ck.greedy_stats(built[name], PROMPTS, kernel_order_check=False)
    print(name, {k: v for k, v in stats.items() if k != "outputs"})
    assert min(stats["distinct"]) >= MIN_DISTINCT, stats["distinct"]
    assert stats["rel_margin_min"] >= MIN_REL_MARGIN, stats
    assert stats["bigram_follow"] >= 0.9, stats


@pytest.mark.parametrize("name", ck.SCREEN_TARGETS)
def test_screened_prompts_keep_their_margins_in_float16(built, name):
    torch.set_num_threads(1)
    stats = ck.greedy_stats(built[name], CTX_PROMPTS)
    print(name, {k: v for k, v in stats.items() if k != "outputs"})
    assert stats["min_gap"] >= ck.MIN_GAP, stats
    # Kernel order alone (float16 decode vs full-sequence forward) flips
    # nothing, and float16 follows the fp32 trajectory.
    assert stats["kernel_order_flips"] == 0 and stats["off_fp32"] == [], stats


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_dense"])
def test_context_moves_the_logits(built, name):
    """Same last token, different history: attention/GDN move the logits as
    a whole (relative L2 ~1); the bigram lead is one spike on top, so they
    decide only some argmaxes."""
    torch.set_num_threads(1)
    model = ck.load_for_cpu(built[name])
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 256, (1, 24), generator=g) for _ in range(2))
    b[0, -1] = a[0, -1]
    with torch.no_grad():
        la, lb = (model(x).logits[0, -1] for x in (a, b))
    rel = float((la - lb).norm() / la.norm())
    assert rel > 0.3, rel


def test_shared_head_draft(built):
    from safetensors.torch import load_file

    main = load_file(glob.glob(str(built["qwen3_next"] / "*.safetensors"))[0])
    draft = load_file(glob.glob(str(built["qwen3_dense_draft"] / "*.safetensors"))[0])
    assert torch.equal(main["lm_head.weight"], draft["lm_head.weight"])
    assert "mtp.fc.weight" in main and not any(k.startswith("mtp.") for k in draft)


def _load_into_vllm(path, engine_kwargs, mtp, init_file):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    cfg = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        max_model_len=256,
        enforce_eager=True,
        speculative_config=spec,
        **engine_kwargs,
    ).create_engine_config()
    missing = {}
    with set_current_vllm_config(cfg):
        ours = not model_parallel_is_initialized()
        if ours:
            init_distributed_environment(1, 0, f"file://{init_file}", 0, "gloo")
            initialize_model_parallel(1, 1)
        try:
            loader = get_model_loader(cfg.load_config)
            configs = [("main", cfg.model_config)]
            if mtp:
                configs.append(("mtp", cfg.speculative_config.draft_model_config))
            for which, model_config in configs:
                with torch.device("meta"):
                    model = initialize_model(vllm_config=cfg, model_config=model_config)
                weights = loader.get_all_weights(cfg.model_config, model)
                loaded = model.load_weights(weights)
                params = {n for n, _ in model.named_parameters()}
                missing[which] = sorted(params - set(loaded))
        finally:
            # Later tests (Gemma 4 layers) initialize their own groups.
            if ours:
                destroy_model_parallel()
                destroy_distributed_environment()
    return missing


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_dense"])
def test_vllm_loads_every_parameter(built, name, tmp_path):
    spec = ck.MODELS[name]
    init_file = tmp_path / "dist_init"
    missing = _load_into_vllm(built[name], spec.engine_kwargs, spec.mtp, init_file)
    assert missing == {"main": [], **({"mtp": []} if spec.mtp else {})}
