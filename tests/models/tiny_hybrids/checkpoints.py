# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Saved tiny random checkpoints whose greedy output can expose a wrong kernel.

``load_format="dummy"`` makes the tiny models emit one token over and over, so
any two engines agree and a token-for-token comparison proves nothing. These
checkpoints are built with transformers' own model classes and initialisation
(normal, std ``initializer_range`` = 0.02; (1 + w) RMSNorms at zero), saved
with ``save_pretrained`` as bf16 safetensors beside the tiny tokenizer, and
then changed in one place, the token embedding:

* **Bigram path.** Embedding row ``x`` is the output-head row of a successor
  token ``f(x)`` (``f`` one random cycle through the vocabulary), scaled to
  ``bigram_gain`` RMS. The residual stream then carries a direction the head
  maps to one token with a large lead, and the attention/GDN/MoE layers (HF
  init, untouched) add a context-dependent vector on top.

  Why not just scale the output head, as the issue suggests: greedy argmax is
  invariant under scaling the head or the final norm, and bf16 rounding is
  relative, so the flip rate between two kernel orders does not change. On
  plain HF init the top-1/top-2 gap is a continuous variable with its density
  at zero: measured on CPU (transformers, bf16, decode vs full-sequence
  forward) 2-5 % of positions flip, so most 64-token prompts would diverge on
  a correct engine. With the bigram path the gap sits several logit standard
  deviations away from zero at almost every position; a faulty kernel (attention
  that skips the cache, a GDN state read from the wrong slot) changes the
  context vector by O(1) and still flips tokens, while kernel-order rounding
  (O(1e-3)) does not. ``greedy_stats`` measures both on CPU.

* **Drafts that get accepted.** The MTP layer's ``fc`` passes the (normed)
  embedding of the next token through (``mtp_gain`` times identity on that
  half, HF noise elsewhere), so MTP drafts follow the bigram chain; the target
  follows it except where context wins, so acceptance is high but not total
  and GDN states after accepted drafts matter. The dense draft beside the
  hybrid main shares its embedding and head (same chain). ``bigram_prompts``
  are stretches of the chain repeated, so ngram drafts get accepted too.

transformers' classes do not create the ``mtp.*`` tensors vLLM's
qwen3_next_mtp.py / qwen3_5_mtp.py load; they are made here with the same
names and shapes as the main model's first full-attention layer (the MTP
layer is a full-attention decoder layer), the same init rule (constant
tensors copied, the rest normal(0, initializer_range)), plus ``mtp.fc``,
``mtp.norm``, ``mtp.pre_fc_norm_hidden`` and ``mtp.pre_fc_norm_embedding``.

    python -m tests.models.tiny_hybrids.checkpoints OUTDIR   # build all, print stats
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import builders
from .tokenizer import TINY_VOCAB_SIZE

SEED = 0
# MTP fc's weight on the next token's embedding (its other inputs are HF
# noise of RMS ~0.45): the drafts follow the chain.
MTP_GAIN = 4.0
NEW_TOKENS = 64


@dataclass(frozen=True)
class TinyModel:
    """One checkpoint kind: how to write its config and how vLLM must load it."""

    builder: str
    # RMS of an embedding row: the bigram direction's weight in the residual
    # stream against the HF-init layers' outputs. 0.02 is HF's own embedding
    # scale. Tuned on CPU (greedy_stats, the 12 matrix prompts x 64 tokens):
    # the largest share of context-decided tokens for which bf16 incremental
    # decode and a bf16 full-sequence forward (chunked vs recurrent GDN,
    # another attention order) still agree on every token. The crossover is
    # narrow: qwen3_next 0.05 -> 2.3 % context-decided, 0.055 -> 1.6 % but
    # 2 of 768 tokens flip between the two bf16 paths, 0.0575 -> 1.0 % and
    # none flip, 0.06 -> 0.4 %; qwen3_5 0.055 -> 0.4 % with 1 flip, 0.0575
    # -> 0.4 % and none, 0.06 -> 0.1 %; qwen3_dense 0.13 -> 4 %, 0.135 ->
    # 2.6 %, 0.15 -> 0 %. On the screened prompts (SCREENED) qwen3_dense at
    # 0.135 has no context-decided token at all (so no fault could show in
    # its cells); 0.13 has 4 of 768, min top-1/top-2 gap 0.0066, no fp16
    # kernel-order flip; 0.125 has 7 but a gap of 0.0019.
    bigram_gain: float
    builder_kwargs: dict[str, Any] = field(default_factory=dict)
    # Extra LLM(...) arguments the checkpoint needs.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    mtp: bool = False
    # Reuse embedding + head of this checkpoint (a draft sharing the chain).
    shares_head_with: str | None = None


# Dense Qwen3 ties its head to the embedding by default; the bigram path
# needs them apart (a tied head maps token x back to x).
_UNTIED = {"overrides": {"tie_word_embeddings": False}}

MODELS: dict[str, TinyModel] = {
    "qwen3_next": TinyModel("qwen3_next", 0.0575, {"mtp_layers": 1}, mtp=True),
    "qwen3_5": TinyModel(
        "qwen3_5_text",
        0.0575,
        {"mtp_layers": 1},
        engine_kwargs={"language_model_only": True},
        mtp=True,
    ),
    # Six GDN layers beside three attention layers and the MTP layer: groups
    # of four, so the fourth KV-cache tensor holds attention layers only and
    # the block pool splits its ids at that tensor's length (the Qwen3.6-27B
    # shape's 48 + 16 + 1 in small).
    "qwen3_5_split": TinyModel(
        "qwen3_5_text",
        # 0.0575 leaves one chain prompt's top two logits 4 % apart at the
        # ninth layer; 0.06 keeps them 30 % apart.
        0.06,
        {"mtp_layers": 1, "num_layers": 9, "full_attention_interval": 3},
        engine_kwargs={"language_model_only": True},
        mtp=True,
    ),
    "qwen3_dense": TinyModel("qwen3_dense", 0.13, _UNTIED),
    # Draft for the hybrid main: a different architecture on the same chain
    # (its embedding directions and head are the main model's), leaning on
    # the chain harder so that it drafts what the main emits where the main
    # follows the chain.
    "qwen3_dense_draft": TinyModel(
        "qwen3_dense", 0.5, _UNTIED, shares_head_with="qwen3_next"
    ),
}


def successor_map(vocab_size: int = TINY_VOCAB_SIZE, seed: int = SEED) -> list[int]:
    """``f`` with ``f[x]`` the bigram successor of ``x``: one cycle over all ids,
    so a pure bigram chain never repeats inside 64 tokens."""
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    succ = [0] * vocab_size
    for i in range(vocab_size):
        succ[int(order[i])] = int(order[(i + 1) % vocab_size])
    return succ


def bigram_chain(start: int, length: int, succ: list[int]) -> list[int]:
    out = [start]
    while len(out) < length:
        out.append(succ[out[-1]])
    return out


_TEXTS = (
    b"the cat sat on the mat. the cat sat on the mat. the cat sat on",
    b"1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    b"abcabcabcabcabcabcabcabcabcab",
    b"def f(x):\n    return x\n\ndef f(x):\n    return",
)


def candidate_prompts(num: int = 60, seed: int = SEED) -> list[list[int]]:
    """The seeded pool ``bigram_prompts`` picks from, three kinds in turn:
    random bytes (ngram finds nothing: zero-draft steps), a stretch of the
    bigram chain repeated (ngram proposes what the model emits: accepted
    drafts), repetitive text (ngram proposes, the model mostly disagrees)."""
    g = torch.Generator().manual_seed(seed + 1)
    succ = successor_map(seed=seed)
    prompts: list[list[int]] = []
    for i in range(num):
        kind = i % 3
        if kind == 0:
            length = 16 + 4 * (i % 5)
            prompts.append(torch.randint(0, 256, (length,), generator=g).tolist())
        elif kind == 1:
            start = int(torch.randint(0, TINY_VOCAB_SIZE, (1,), generator=g))
            stretch = bigram_chain(start, 16, succ)
            prompts.append(stretch + stretch[:10])
        elif i // 3 < len(_TEXTS):
            prompts.append(list(_TEXTS[i // 3]))
        else:
            unit = torch.randint(32, 127, (3 + i % 6,), generator=g).tolist()
            prompts.append((unit * 12)[: 24 + 2 * (i % 7)])
    return prompts


# The GPU checks run these checkpoints in float16, not bfloat16: same
# weights (bf16 values are fp16 values at this scale), 3 more mantissa bits,
# so ~8x less rounding noise, while a wrong attention/GDN result moves the
# logits as much as before. Measured on the H100 in bf16 (quick matrix, 9
# cells): 5 cells had one prompt diverge at a reference gap of 0.006-0.013
# logits, and the same tokens flipped between the auto-KV eager and graph
# references: rounding. The injected GDN fault flipped tokens at gaps of
# 0.016-0.023: in bf16 the two are not separable. On CPU (transformers, 20
# prompts incl. those near-ties) qwen3_next in fp16 stays on the fp32
# trajectory everywhere, in bf16 it leaves it at a 0.0085 gap.
# vLLM's TurboQuant, FlashAttention, FLA GDN and Triton MoE paths all accept
# float16 (TurboQuantAttentionBackend.supported_dtypes, FlashAttention's).
MATRIX_DTYPE = "float16"

# Indices into candidate_prompts(POOL) of the matrix prompts: the first 12
# candidates except those whose greedy fp32 trajectory has a top-1/top-2
# logit gap below MIN_GAP on a target checkpoint (qwen3_next, qwen3_5,
# qwen3_dense), replaced by later repetitive-text candidates, the kind where
# context decides tokens. Dropped: 2 (0.006 on qwen3_next, the H100's
# "DIFF 2@22 tie") and 8 (0.0012 on qwen3_dense), and random-byte 6 and 9
# (context decides nothing there) for more context-deciding text. Kept: 5
# (0.013, its "5@11" tie in bf16; 6x above fp16 rounding), added 17, 23,
# 26, 44 (min gaps 0.026, 0.056, 0.054, 0.014; 2-4 context-decided tokens
# each). ``python -m tests.models.tiny_hybrids.checkpoints OUT --screen``
# prints the table this was read from.
POOL = 60
MIN_GAP = 0.01
SCREENED: tuple[int, ...] = (0, 1, 3, 4, 5, 7, 10, 11, 17, 23, 26, 44)


def bigram_prompts(num: int = 12, seed: int = SEED) -> list[list[int]]:
    """The matrix prompts: the screened candidates (SCREENED), then further
    candidates if more than len(SCREENED) are asked for."""
    pool = candidate_prompts(max(POOL, num), seed)
    picked = list(SCREENED) if seed == SEED else []
    picked += [i for i in range(len(pool)) if i not in picked]
    return [pool[i] for i in picked[:num]]


def _model_class(config):
    import transformers

    arch = config.architectures[0]
    return getattr(transformers, arch)


def hf_config(path: str | Path):
    """The checkpoint's config as transformers' own class for its model_type.

    Not ``AutoConfig``: it answers with the class registered last, and vLLM's
    config parser registers its own for qwen3_5 in the process. That class's
    vision config has no ``rope_parameters``, which transformers 5.17's vision
    tower reads, so a checkpoint built after any engine or ModelConfig in the
    same process failed there (the GPU suite's order)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return getattr(transformers, CONFIG_MAPPING_NAMES[model_type]).from_pretrained(path)


def _is_constant(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool((t == t.flatten()[0]).all())


def _mtp_tensors(
    state: dict[str, torch.Tensor],
    layers_prefix: str,
    attn_layer: int,
    hidden: int,
    std: float,
    gain: float,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """``mtp.*`` tensors named as vLLM's MTP ``load_weights`` expects."""
    src = f"{layers_prefix}{attn_layer}."
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not name.startswith(src):
            continue
        suffix = name[len(src) :]
        if _is_constant(t):
            new = t.clone()
        else:
            new = torch.empty(t.shape, dtype=torch.float32).normal_(
                0, std, generator=gen
            )
        out[f"mtp.layers.0.{suffix}"] = new.to(t.dtype)
    dtype = next(iter(out.values())).dtype
    norm = state[f"{layers_prefix.rsplit('layers.', 1)[0]}norm.weight"]
    for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        out[f"mtp.{n}.weight"] = norm.clone()
    fc = torch.empty(hidden, 2 * hidden).normal_(0, std, generator=gen)
    # First half of fc's input is the normed embedding of the next token.
    fc[:, :hidden] += gain * torch.eye(hidden)
    out["mtp.fc.weight"] = fc.to(dtype)
    return out


def _unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors, as vLLM 0.20.2's Qwen3-Next loader reads them.

    transformers 5.14 saves MoE experts per expert; should a later version
    save its fused ``experts.gate_up_proj`` ([E, 2I, H], gate first) and
    ``experts.down_proj`` ([E, H, I]) instead, split them here."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def _layers_prefix(state: dict[str, torch.Tensor]) -> str:
    for p in ("model.language_model.layers.", "model.layers."):
        if any(k.startswith(p) for k in state):
            return p
    raise KeyError(f"no decoder layers in checkpoint; keys start {sorted(state)[:3]}")


def write_config(name: str, path: str | Path, spec: TinyModel | None = None) -> Path:
    """config.json + tokenizer of checkpoint ``name``, no weights (for
    config-level checks). ``spec`` replaces ``MODELS[name]``."""
    spec = spec or MODELS[name]
    builders.BUILDERS[spec.builder](path, with_tokenizer=True, **spec.builder_kwargs)
    return Path(path)


def build_checkpoint(
    name: str,
    path: str | Path,
    *,
    seed: int = SEED,
    bigram_gain: float | None = None,
    mtp_gain: float = MTP_GAIN,
    share_from: str | Path | None = None,
    spec: TinyModel | None = None,
) -> Path:
    """Write checkpoint ``name`` (a key of ``MODELS``) into ``path``.

    ``share_from`` is the directory of the checkpoint named by
    ``shares_head_with`` (required for such models). ``spec`` replaces
    ``MODELS[name]`` (variants of a checkpoint: other layer counts, heads).
    """
    from safetensors.torch import load_file, save_file

    spec = spec or MODELS[name]
    if bigram_gain is None:
        bigram_gain = spec.bigram_gain
    path = write_config(name, path, spec)
    config = hf_config(path)
    text = config.get_text_config()
    torch.manual_seed(seed)
    model = _model_class(config)._from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)

    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(
            f"expected one safetensors shard in {path}, found {len(files)}; "
            "raise max_shard_size or merge them"
        )
    state = _unfuse_experts(load_file(files[0]))
    embed = next(k for k in state if k.endswith("embed_tokens.weight"))
    if spec.shares_head_with is not None:
        if share_from is None:
            raise ValueError(
                f"{name} shares its head: pass share_from=<checkpoint dir>"
            )
        other = load_file(next(Path(share_from).glob("*.safetensors")))
        state["lm_head.weight"] = other["lm_head.weight"].clone()
    head = state["lm_head.weight"].float()
    succ = torch.tensor(successor_map(head.shape[0], seed))
    rows = head[succ]
    rows = rows / rows.pow(2).mean(-1, keepdim=True).sqrt()
    state[embed] = (bigram_gain * rows).to(state[embed].dtype)
    if spec.mtp:
        layer_types = text.layer_types
        gen = torch.Generator().manual_seed(seed + 7)
        state.update(
            _mtp_tensors(
                state,
                _layers_prefix(state),
                layer_types.index("full_attention"),
                text.hidden_size,
                text.initializer_range,
                mtp_gain,
                gen,
            )
        )
    save_file(state, str(files[0]), metadata={"format": "pt"})
    (path / "hybridkv_tiny.json").write_text(
        json.dumps(
            {
                "name": name,
                "seed": seed,
                "bigram_gain": bigram_gain,
                "mtp_gain": mtp_gain,
            },
            indent=1,
        )
        + "\n"
    )
    return path


def build_all(
    root: str | Path,
    names: list[str] | None = None,
    gains: dict[str, float] | None = None,
) -> dict[str, Path]:
    """Build ``names`` (default all) under ``root``; sharing order respected.
    ``gains`` overrides ``bigram_gain`` per name."""
    gains = gains or {}
    unknown = set(gains) - set(MODELS)
    if unknown:
        raise ValueError(
            f"unknown checkpoints {sorted(unknown)}; known: {list(MODELS)}"
        )
    root = Path(root)
    names = list(names or MODELS)
    for n in list(names):
        other = MODELS[n].shares_head_with
        if other and other not in names:
            names.insert(0, other)
    names.sort(key=lambda n: MODELS[n].shares_head_with is not None)
    out: dict[str, Path] = {}
    for n in names:
        other = MODELS[n].shares_head_with
        out[n] = build_checkpoint(
            n,
            root / n,
            bigram_gain=gains.get(n),
            share_from=out.get(other) if other else None,
        )
    return out


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """An identical-weights copy (a draft of the target's own config)."""
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def load_for_cpu(path: str | Path):
    """The saved checkpoint in transformers, fp32 (bf16-rounded weights), eval."""
    config = hf_config(path)
    model = _model_class(config).from_pretrained(path, dtype=torch.float32)
    return model.eval()


SCREEN_TARGETS = ("qwen3_next", "qwen3_5", "qwen3_dense")


@torch.no_grad()
def greedy(
    model, prompt: list[int], new_tokens: int = NEW_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of ``prompt`` (the new tokens) and the fp32 logits
    of every generated position, ``[new_tokens, vocab]``."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :], torch.stack(out.logits, 1)[0].float()


def trajectory(
    model, prompt: list[int], new_tokens: int = NEW_TOKENS
) -> tuple[list[int], list[float]]:
    """Greedy continuation and, per position, the top-1/top-2 logit gap."""
    gen, scores = greedy(model, prompt, new_tokens)
    top2 = scores.topk(2, -1).values
    return gen.tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def context_decided(prompt: list[int], output: list[int], seed: int = SEED) -> int:
    """Generated tokens that are not the bigram successor of the one before."""
    succ = successor_map(seed=seed)
    seq = prompt[-1:] + output
    return sum(succ[a] != b for a, b in zip(seq, seq[1:]))


def screen(
    paths: dict[str, Path], prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> list[dict[str, Any]]:
    """Per prompt and target checkpoint (fp32 compute on the saved weights):
    the smallest top-1/top-2 logit gap along the greedy trajectory and the
    context-decided tokens in it."""
    rows: list[dict[str, Any]] = [{"index": i} for i in range(len(prompts))]
    for name in SCREEN_TARGETS:
        model = load_for_cpu(paths[name])
        model.generation_config.eos_token_id = None
        for row, p in zip(rows, prompts):
            out, gaps = trajectory(model, p, new_tokens)
            row[name] = {"min_gap": min(gaps), "ctx": context_decided(p, out)}
    for row in rows:
        row["min_gap"] = min(row[n]["min_gap"] for n in SCREEN_TARGETS)
        row["ctx"] = sum(row[n]["ctx"] for n in SCREEN_TARGETS)
    return rows


@torch.no_grad()
def greedy_stats(
    path: str | Path,
    prompts: list[list[int]],
    new_tokens: int = NEW_TOKENS,
    seed: int = SEED,
    kernel_order_check: bool = True,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Greedy decode on CPU and what decides whether the GPU check can work.

    Returns per prompt the distinct tokens; over all positions the top-1/top-2
    logit gap in units of each position's logit std (``rel_margin_*``), the
    share of positions where the output is the bigram successor of the input
    (``bigram_follow``, a proxy for draft acceptance), and with
    ``kernel_order_check`` the share of positions whose argmax differs between
    incremental decode and a full-sequence forward in ``dtype`` (default
    MATRIX_DTYPE, what the GPU checks run; ``kernel_order_flips``: what
    kernel-order rounding alone does) and the prompts whose decode in
    ``dtype`` leaves the fp32 trajectory (``off_fp32``).
    """
    model = load_for_cpu(path)
    # vLLM runs with ignore_eos (EOS is emitted, not suppressed); here too.
    model.generation_config.eos_token_id = None
    succ = torch.tensor(successor_map(seed=seed))
    distinct, margins, follow, outputs, gaps = [], [], [], [], []
    for p in prompts:
        gen, scores = greedy(model, p, new_tokens)
        outputs.append(gen.tolist())
        distinct.append(len(set(gen.tolist())))
        top2 = scores.topk(2, -1).values
        margins.append((top2[:, 0] - top2[:, 1]) / scores.std(-1))
        gaps.append(float((top2[:, 0] - top2[:, 1]).min()))
        prev = torch.cat([torch.tensor(p[-1:]), gen[:-1]])
        follow.append((succ[prev] == gen).float())
    rel = torch.cat(margins)
    stats: dict[str, Any] = {
        "distinct": distinct,
        "rel_margin_min": float(rel.min()),
        "rel_margin_p01": float(torch.quantile(rel, 0.01)),
        "rel_margin_median": float(rel.median()),
        "min_gap": min(gaps),
        "bigram_follow": float(torch.cat(follow).mean()),
        "outputs": outputs,
    }
    if kernel_order_check:
        model = model.to(dtype or getattr(torch, MATRIX_DTYPE))
        flips = 0
        total = 0
        off = []
        for p, gen in zip(prompts, outputs):
            step, _ = greedy(model, p, new_tokens)
            seq = torch.cat([torch.tensor(p), step])[None]
            full = model(seq).logits[0, len(p) - 1 : -1].argmax(-1)
            flips += int((full != step).sum())
            total += new_tokens
            if step.tolist() != gen:
                off.append(prompts.index(p))
        stats["kernel_order_flips"] = flips / total
        stats["off_fp32"] = off
    return stats


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--no-stats", action="store_true")
    parser.add_argument(
        "--screen",
        action="store_true",
        help="min top-1/top-2 gap and context-decided tokens of every "
        "candidate prompt (candidate_prompts(POOL)) on every target",
    )
    args = parser.parse_args(argv)
    paths = build_all(args.outdir)
    if args.screen:
        for r in screen(paths, candidate_prompts(POOL)):
            per = " ".join(
                f"{n}={r[n]['min_gap']:.4f}/{r[n]['ctx']}" for n in SCREEN_TARGETS
            )
            mark = "*" if r["index"] in SCREENED else " "
            print(
                f"{mark}{r['index']:>3} min_gap={r['min_gap']:.4f} ctx={r['ctx']} {per}"
            )
        return 0
    if args.no_stats:
        return 0
    prompts = bigram_prompts(args.prompts)
    for name, p in paths.items():
        s = greedy_stats(p, prompts)
        s.pop("outputs")
        print(name, json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
