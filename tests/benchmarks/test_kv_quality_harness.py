# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-quality harness (benchmarks/quality/) without a GPU: its needle
cases, perplexity from prompt logprobs, agreement with auto, the table, the
children's bookkeeping (ok, failed, crash, timeout, deadline) and its refusals
(exit status 2)."""

import json
import math
import os
import random
import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks import import_benchmark

pytestmark = pytest.mark.cpu_test

SKIP_REAL = "HYBRIDKV_SKIP_REAL_WEIGHTS"
PREAMBLE = Path(__file__).parents[1] / "models/real_weights/data/gpl3_preamble.txt"


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("benchmarks.quality.benchmark_kv_quality")


class WordTokenizer:
    """Each run of whitespace plus the word after it is one token; id 0 is
    <bos>, which it puts first unless told not to."""

    def __init__(self):
        self.vocab = {"<bos>": 0}
        self.pieces = ["<bos>"]

    def _id(self, piece):
        if piece not in self.vocab:
            self.vocab[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.vocab[piece]

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        spans = [m.span() for m in re.finditer(r"\s*\S+|\s+", text)]
        ids = [self._id(text[a:b]) for a, b in spans]
        if add_special_tokens:
            ids, spans = [0, *ids], [(0, 0), *spans]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids if i != 0)


def _text(paragraphs=40):
    # Sentences of 8-12 words, paragraphs of 5 sentences: boundaries everywhere.
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota"]
    out = []
    for p in range(paragraphs):
        sentences = []
        for s in range(5):
            n = 8 + (p + s) % 5
            body = " ".join(words[(p * 7 + s * 3 + i) % len(words)] for i in range(n))
            sentences.append(body.capitalize() + ".")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


def _find(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


def _check_cases(inputs, tok, corpus, prefix, cases, lengths, per_cell):
    assert len(cases) == len(lengths) * len(inputs.DEPTHS) * per_cell
    for c in cases:
        assert len(c.prompt) == c.length, (c.length, len(c.prompt))
        assert c.prompt[: len(prefix)] == prefix
        needle = inputs.encode(
            tok, " " + inputs.NEEDLE.format(word=c.word, number=c.number)
        )
        assert _find(c.prompt, needle) == [c.needle_at]
        assert c.needle_tokens == len(needle)
        question = inputs.encode(tok, inputs.QUESTION.format(word=c.word))
        assert c.prompt[-len(question) :] == question
        # The haystack (prompt without prefix, needle, question) is the
        # corpus from the case's offset, and the needle sits near its depth.
        hay_len = c.length - len(prefix) - len(needle) - len(question)
        at = c.needle_at - len(prefix)
        assert abs(at / hay_len - c.depth) <= 0.06, (c.depth, at / hay_len)
        hay = (
            c.prompt[len(prefix) : c.needle_at]
            + c.prompt[c.needle_at + len(needle) : c.length - len(question)]
        )
        assert hay == inputs.take(corpus.ids, c.haystack_offset, hay_len)
        # The answer is the needle's number, 7 digits, which only it holds.
        assert re.fullmatch(r"\d{7}", c.number) and c.number not in corpus.text
        text = tok.decode(c.prompt)
        assert text.count(c.number) == 1
        assert f"the {c.word} vault is {c.number}." in text
        assert text.endswith(f"for the {c.word} vault is")
        # The answer scored under teacher forcing continues the completion.
        answered = tok.decode(c.prompt + c.answer)
        assert answered.endswith(f"for the {c.word} vault is {c.number}")


def test_needle_cases_fit_hold_the_needle_once_near_the_depth(bench):
    inputs = bench.kvq_inputs
    tok = WordTokenizer()
    corpus = inputs.tokenize_corpus(tok, _text())
    prefix = inputs.special_prefix(tok)
    assert prefix == [0]
    lengths = (256, 1024)
    cases = inputs.needle_cases(corpus, tok, prefix, lengths, per_cell=3)
    _check_cases(inputs, tok, corpus, prefix, cases, lengths, 3)
    assert all(c.at_sentence_end for c in cases)
    # Three different vaults per length and depth.
    for length in lengths:
        for d in inputs.DEPTHS:
            words = {c.word for c in cases if (c.length, c.depth) == (length, d)}
            assert len(words) == 3


def test_needle_cases_are_deterministic(bench):
    inputs = bench.kvq_inputs

    def build():
        tok = WordTokenizer()
        corpus = inputs.tokenize_corpus(tok, _text())
        return [
            (c.meta(), c.prompt)
            for c in inputs.needle_cases(corpus, tok, [0], (300,), per_cell=2)
        ]

    assert build() == build()


def test_needle_samples_draw_other_cases_and_sample_0_keeps_the_old_ones(bench):
    """``--needle-sample``: sample 0's seed is the one every earlier table
    used (its first case is pinned here), and another sample draws other
    words, numbers and haystack offsets over the same grid."""
    inputs = bench.kvq_inputs
    tok = WordTokenizer()
    corpus = inputs.tokenize_corpus(tok, _text())

    def cases(sample):
        return inputs.needle_cases(corpus, tok, [0], (300,), per_cell=2, sample=sample)

    first = cases(0)[0]
    rng = random.Random("kv-quality-needle:300:0.1")
    assert first.word == rng.sample(inputs.WORDS, 2)[0]
    assert [c.meta() for c in cases(0)] == [
        c.meta() for c in inputs.needle_cases(corpus, tok, [0], (300,), per_cell=2)
    ]
    other = cases(1)
    _check_cases(inputs, tok, corpus, [0], other, (300,), 2)
    drawn = {(c.word, c.number, c.haystack_offset) for c in other}
    assert drawn.isdisjoint((c.word, c.number, c.haystack_offset) for c in cases(0))
    assert [c.meta() for c in other] == [c.meta() for c in cases(1)]


def test_needle_cases_with_smollm2_tokenizer(bench):
    if os.environ.get(SKIP_REAL) == "1":
        pytest.skip(f"{SKIP_REAL}=1: real checkpoints not fetched")
    from transformers import AutoTokenizer

    from tests.models.real_weights import checkpoints as ck

    tok = AutoTokenizer.from_pretrained(ck.build("smollm2_135m"))
    inputs = bench.kvq_inputs
    text = PREAMBLE.read_text() * 4
    corpus = inputs.tokenize_corpus(tok, text)
    prefix = inputs.special_prefix(tok)
    assert prefix == []  # SmolLM2's tokenizer adds no BOS
    lengths = (512, 1024)
    cases = inputs.needle_cases(corpus, tok, prefix, lengths, per_cell=2)
    _check_cases(inputs, tok, corpus, prefix, cases, lengths, 2)
    built = inputs.build_inputs(tok, text, lengths, 300, 8, 1)
    assert [len(w) for w in built["prompts"]["ppl"]] == [300] * 8
    assert [len(p) for p in built["prompts"]["agreement"]][::5] == [
        200,
        633,
        1067,
        1500,
    ]


def test_sentence_ends_need_whitespace_after_the_stop(bench):
    ends = bench.kvq_inputs.sentence_ends(
        ["Version", " 2", ".", "1", " applies", ".", " It", " ends", '."', "\n"]
    )
    assert ends == [False, False, False, False, False, True, False, False, True, False]


def test_ppl_windows_do_not_overlap_and_start_with_the_prefix(bench):
    inputs = bench.kvq_inputs
    corpus = inputs.Corpus(text="x", ids=list(range(100, 1100)), ends=[False] * 1000)
    windows = inputs.ppl_windows(corpus, [7], window=300, max_windows=8)
    assert len(windows) == 3  # 1000 // 299
    assert all(len(w) == 300 and w[0] == 7 for w in windows)
    body = [t for w in windows for t in w[1:]]
    assert body == list(range(100, 100 + 3 * 299))
    assert len(inputs.ppl_windows(corpus, [7], 300, max_windows=2)) == 2
    with pytest.raises(inputs.InputError, match="fewer than one perplexity window"):
        inputs.ppl_windows(corpus, [], window=2000, max_windows=8)


def _prompt_logprobs(prompt, logprobs, alternatives=True):
    # vLLM's shape: None first, then {token id: Logprob} holding the prompt
    # token (and, with top-k > 0, others).
    out = [None]
    for tok, lp in zip(prompt[1:], logprobs):
        entry = {tok: SimpleNamespace(logprob=lp, rank=1 if lp >= -1 else 3)}
        if alternatives:
            entry[tok + 1000] = SimpleNamespace(logprob=-0.01, rank=1)
        out.append(entry)
    return out


def test_perplexity_from_prompt_logprobs_skips_the_first_token(bench):
    m = bench.measures
    a, b = [5, 6, 7, 8], [9, 10, 11]
    lp_a, lp_b = [-1.0, -2.0, -3.0], [-0.5, -1.5]
    w = [
        m.window_nll(a, _prompt_logprobs(a, lp_a)),
        m.window_nll(b, _prompt_logprobs(b, lp_b, False)),
    ]
    assert w[0] == {"nll": 6.0, "tokens": 3, "top1": 1}
    s = m.perplexity_summary(w)
    assert s["tokens"] == 5
    assert s["ppl"] == pytest.approx(math.exp(8.0 / 5))
    assert s["windows"][1]["ppl"] == pytest.approx(math.exp(1.0))
    assert s["top1_pct"] == pytest.approx(40.0)
    # A logprob for another token than the prompt's is a semantics error.
    bad = _prompt_logprobs(a, lp_a)
    bad[2] = {99: SimpleNamespace(logprob=-1.0, rank=1)}
    with pytest.raises(
        ValueError, match="position 2: no logprob for the prompt token 7"
    ):
        m.window_nll(a, bad)
    with pytest.raises(ValueError, match="3 prompt logprobs for 4 tokens"):
        m.window_nll(a, bad[:3])
    # From a later token on: a needle's answer after its prompt.
    assert m.window_nll(a, _prompt_logprobs(a, lp_a), start=2) == {
        "nll": 5.0,
        "tokens": 2,
        "top1": 0,
    }
    with pytest.raises(ValueError, match="no token to score from 4 of 4"):
        m.window_nll(a, _prompt_logprobs(a, lp_a), start=4)


def test_answer_nll_paired_with_auto(bench):
    m = bench.measures
    scored = [
        {"nll": 1.0, "tokens": 2, "top1": 2},
        {"nll": 4.0, "tokens": 2, "top1": 1},
    ]
    s = m.answer_summary(scored)
    assert s == {"nll": [1.0, 4.0], "top1": [True, False], "mean_nll": 2.5}
    d = m.paired_difference([1.0, 4.0, 2.0], [1.5, 4.0, 3.5])
    # Differences 0.5, 0, 1.5: mean 2/3, sample sd sqrt(7/12).
    assert d["mean"] == pytest.approx(2 / 3) and d["cases"] == 3
    assert d["se"] == pytest.approx(math.sqrt(7 / 12 / 3))
    with pytest.raises(ValueError, match="2 cases paired with 3"):
        m.paired_difference([1.0, 4.0, 2.0], [1.0, 2.0])


def test_agreement_counts_tokens_before_the_first_difference(bench):
    m = bench.measures
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    out = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    a = m.agreement(ref, out)
    assert (a["matched"], a["total"]) == (4 + 2 + 0, 12)
    assert a["pct"] == pytest.approx(50.0)
    assert (a["prompts_equal"], a["prompts"]) == (1, 3)
    assert a["first_diff"] == [None, 2, 0]
    assert m.agreement(ref, ref)["pct"] == 100.0
    with pytest.raises(ValueError):
        m.agreement(ref, out[:2])


def test_recall_per_length_and_depth(bench):
    cases = [{"length": n, "depth": d} for n in (100, 200) for d in (0.1, 0.9)]
    r = bench.measures.recall_summary(cases, [True, True, False, True])
    assert r["recall_pct"] == 75.0
    assert r["ci95_pct"] == pytest.approx(bench.measures.wilson_interval(3, 4))
    assert r["per_length"] == {"100": 100.0, "200": 50.0}
    assert r["per_depth"] == {"0.1": 50.0, "0.9": 100.0}


@pytest.mark.parametrize(
    "hits, n, lo, hi",
    # Wilson's score interval (z = 1.96), worked by hand.
    [(54, 60, 79.85, 95.34), (60, 60, 93.98, 100.0), (0, 10, 0.0, 27.75)],
)
def test_recall_interval_is_wilsons(bench, hits, n, lo, hi):
    got = bench.measures.wilson_interval(hits, n)
    assert got == pytest.approx((lo, hi), abs=0.01)
    with pytest.raises(ValueError, match="needs cases"):
        bench.measures.wilson_interval(0, 0)


def test_needles_lost_and_gained_against_the_reference(bench):
    got = bench.measures.needles_lost([1, 1, 0, 1, 0], [1, 0, 1, 0, 0])
    assert got == {"lost": 2, "gained": 1}
    with pytest.raises(ValueError, match="against"):
        bench.measures.needles_lost([1], [1, 0])


def _cell(model, kv, skip="default", status="ok", **extra):
    key = f"{model}.{kv}.{skip.replace(':', '')}"
    return dict(key=key, model=model, kv=kv, skip=skip, status=status, **extra)


def _needle_meta(lengths=(1024, 2048)):
    cases = [
        {"length": n, "depth": d, "number": "1234567"}
        for n in lengths
        for d in (0.1, 0.9)
    ]
    return {"needle": {"lengths": list(lengths), "cases": cases}}


def test_ratio_to_auto_carries_its_spread_over_windows(bench):
    """Each window is paired with auto's same window: the table shows the
    ratio ± the standard error of the windows' mean log ratio."""
    windows = lambda nlls: [{"nll_mean": v} for v in nlls]  # noqa: E731
    auto = _cell("m", "auto", ppl={"ppl": 10.0, "windows": windows([2.0, 2.2, 2.4])})
    tq = _cell(
        "m",
        "turboquant_3bit_nc",
        "boundary:0",
        ppl={"ppl": 10.3, "windows": windows([2.01, 2.23, 2.41])},
    )
    bench.compare_with_auto([auto, tq], {"m": _needle_meta()})
    vs = tq["ppl"]["windows_vs_auto"]
    assert vs["mean"] == pytest.approx(0.05 / 3)
    assert vs["cases"] == 3
    assert vs["se"] == pytest.approx(
        statistics.stdev([0.01, 0.03, 0.01]) / math.sqrt(3)
    )
    assert bench.kvq_report._ratio(tq["ppl"]) == f"1.0300 ± {vs['se']:.4f}"
    assert "windows_vs_auto" not in auto["ppl"]
    # Without windows (older results) the ratio stands alone.
    assert bench.kvq_report._ratio({"ratio_to_auto": 1.03}) == "1.0300"


def test_compare_with_auto_fills_ratio_agreement_and_cases(bench):
    meta = {"m": _needle_meta()}
    auto = _cell(
        "m", "auto", ppl={"ppl": 10.0}, agreement={"outputs": [[1, 2], [3, 4]]}
    )
    auto["needle"] = {"recall_pct": 75.0, "answers": [{"hit": h} for h in (1, 1, 0, 1)]}
    tq = _cell(
        "m",
        "turboquant_k8v4",
        ppl={"ppl": 10.5},
        agreement={"outputs": [[1, 2], [3, 0]]},
        needle={"recall_pct": 50.0, "answers": [{"hit": h} for h in (1, 0, 1, 0)]},
    )
    cells = [auto, tq]
    bench.compare_with_auto(cells, meta)
    assert tq["ppl"]["ratio_to_auto"] == pytest.approx(1.05)
    assert auto["ppl"]["ratio_to_auto"] == 1.0
    assert tq["agreement"]["pct"] == 75.0 and tq["agreement"]["prompts_equal"] == 1
    assert auto["agreement"]["pct"] == 100.0
    assert [c["hit"] for c in tq["needle"]["cases"]] == [1, 0, 1, 0]
    assert tq["needle"]["cases"][2]["length"] == 2048
    assert (tq["needle"]["lost"], tq["needle"]["gained"]) == (2, 1)
    assert (auto["needle"]["lost"], auto["needle"]["gained"]) == (0, 0)
    # Compared again (a re-read run): the same counts from the kept cases.
    bench.compare_with_auto(cells, meta)
    assert (tq["needle"]["lost"], tq["needle"]["gained"]) == (2, 1)


def test_markdown_one_table_per_model_with_failures_listed(bench):
    result = {
        "meta": {
            "date": "2026-11-28T00:00:00+00:00",
            "command": "python benchmarks/quality/benchmark_kv_quality.py --model m=/x",
            "devices": [{"index": "0", "name": "NVIDIA H200"}],
            "versions": {"vllm": "0.20.2+hybridkv.28", "torch": "2.11.0"},
            "complete": True,
        },
        "models": {
            "m": {
                "dir": "/x",
                "context": 8192,
                "inputs": {
                    **_needle_meta(),
                    "corpus_tokens": 30074,
                    "ppl": {"windows": 8, "window_tokens": 3000},
                },
            }
        },
        "cells": [
            _cell(
                "m",
                "auto",
                kv_tokens=136000,
                facts={"quantized_layers": 0, "attention_layers": 30},
                ppl={"ppl": 15.8512, "ratio_to_auto": 1.0},
                needle={
                    "recall_pct": 100.0,
                    "per_length": {"1024": 100.0, "2048": 100.0},
                },
                agreement={"pct": 100.0, "prompts_equal": 16, "prompts": 16},
            ),
            _cell(
                "m",
                "turboquant_3bit_nc",
                "boundary:0",
                facts={
                    "quantized_layers": 30,
                    "attention_layers": 30,
                    "kv_bits": {"quantized": 3.375, "cache": 3.375},
                },
                ppl={"ppl": 17.0, "ratio_to_auto": 1.0725},
                needle={
                    "recall_pct": 75.0,
                    "ci95_pct": [30.06, 95.44],
                    "lost": 1,
                    "gained": 0,
                    "per_length": {"1024": 100.0, "2048": 50.0},
                },
                agreement={"pct": 41.25, "prompts_equal": 3, "prompts": 16},
                answer={"vs_auto": {"mean": 0.42, "se": 0.105, "cases": 4}},
            ),
            _cell("m", "fp8", status="crash", root_cause="ValueError: boom"),
        ],
    }
    md = bench.kvq_report.markdown(result)
    assert "1x NVIDIA H200" in md and "vllm 0.20.2+hybridkv.28" in md
    assert "`python benchmarks/quality/benchmark_kv_quality.py --model m=/x`" in md
    assert md.count("## m") == 1
    assert "needle recall over 4 cases of sample 0 (lengths 1024, 2048;" in md
    lines = md.splitlines()
    head = next(ln for ln in lines if ln.startswith("| KV"))
    assert "| @1024 | @2048 |" in head
    rows = [ln for ln in lines if ln.startswith("| ") and ln != head]
    auto = "| auto | — | 0/30 | — | 136,000 | 15.851 | 1.0000 | 100.0 | — | — "
    assert rows[0] == auto + "| 100 | 100 | 100.0 | 16/16 | ok |"
    tq = "| turboquant_3bit_nc | boundary:0 | 30/30 | 3.38 / 3.38 | — | 17.000 "
    tq += "| 1.0725 | 75.0 (30-95) | 1 / 0 | +0.420 ± 0.105 "
    assert rows[1] == tq + "| 100 | 50 | 41.2 | 3/16 | ok |"
    assert "| fp8 | — | — | — | — | — | — | — | — | — | — | — | — | — | crash |" in md
    assert "- `m.fp8.default`: crash — ValueError: boom" in md


def test_per_token_head_cells_only_when_named(bench):
    """vLLM's per-token-head caches are cells of their own, run once like
    fp8, when --kv names them; the default table does not change."""
    args = bench.parse_args(["--kv", "auto", "int8_per_token_head"])
    cells = bench.plan_cells(["gemma3_270m"], args.kv, args.skip)
    assert [(c.kv, c.skip) for c in bench.run_order(cells)] == [
        ("auto", "default"),
        ("int8_per_token_head", "default"),
    ]
    default = bench.parse_args([]).kv
    assert "int8_per_token_head" not in default
    assert "fp8_per_token_head" not in default
    assert "turboquant_3bit_pair_nc" not in default


def test_the_pair_preset_takes_skip_settings_when_named(bench):
    args = bench.parse_args(["--kv", "auto", "turboquant_3bit_pair_nc"])
    cells = bench.plan_cells(["smollm2_135m"], args.kv, args.skip)
    assert [(c.kv, c.skip) for c in cells] == [
        ("auto", "default"),
        ("turboquant_3bit_pair_nc", "default"),
        ("turboquant_3bit_pair_nc", "boundary:0"),
    ]


def test_cells_twenty_for_two_models_auto_first(bench):
    cells = bench.plan_cells(
        ["smollm2_135m", "gemma3_270m"], bench.KV_DTYPES, list(bench.SKIPS)
    )
    assert len(cells) == 20
    assert len({c.key for c in cells}) == 20
    assert all(re.fullmatch(r"[\w.-]+", c.key) for c in cells)
    order = bench.run_order(cells)
    assert [c.kv for c in order[:2]] == ["auto", "auto"]
    assert order[2] == bench.Cell("gemma3_270m", "turboquant_k8v4", "default")
    assert all(c.skip == "boundary:0" for c in order[-8:])
    # --skip narrows the TurboQuant cells; auto and fp8 still run once.
    narrow = bench.plan_cells(
        ["gemma3_270m"], ["auto", "fp8", "turboquant_k8v4"], ["boundary:0"]
    )
    assert [(c.kv, c.skip) for c in narrow] == [
        ("auto", "default"),
        ("fp8", "default"),
        ("turboquant_k8v4", "boundary:0"),
    ]


def test_engine_kwargs_pass_the_skip_list_only_when_not_default(bench):
    kw = bench.engine_kwargs(
        bench.Cell("gemma3_270m", "turboquant_4bit_nc", "default"), 3
    )
    assert "kv_cache_dtype_skip_layers" not in kw
    assert kw["kv_cache_dtype"] == "turboquant_4bit_nc"
    assert kw["max_model_len"] == 32768 and kw["kv_cache_memory_bytes"] == 3 << 30
    assert kw["max_num_batched_tokens"] == 512 and kw["enforce_eager"] is True
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is True
    kw = bench.engine_kwargs(
        bench.Cell("smollm2_135m", "turboquant_4bit_nc", "boundary:0"), 3
    )
    assert kw["kv_cache_dtype_skip_layers"] == ["boundary:0"]
    assert kw["max_model_len"] == 8192
    assert "attention_backend" not in kw


def test_attention_backend_reaches_every_cell_and_a_wrong_name_exits_2(
    bench, tmp_path, capsys
):
    """``--attention-backend TRITON_ATTN`` (FP8 layers on Triton attention
    instead of FlashAttention) is vLLM's own argument, passed to every cell; a
    name vLLM does not know is refused before any engine starts."""
    for cell in (
        bench.Cell("gemma3_270m", "fp8", "default"),
        bench.Cell(
            "gemma3_270m", "turboquant_3bit_nc", "boundary:0,sliding_window=fp8"
        ),
    ):
        kw = bench.engine_kwargs(cell, 3, "TRITON_ATTN")
        assert kw["attention_backend"] == "TRITON_ATTN"
    ck = _checkpoint(tmp_path)
    argv = ["--model", f"smollm2_135m={ck}", "--attention-backend", "TRITON"]
    assert _exit_code(bench, argv) == 2
    err = capsys.readouterr().err
    assert "--attention-backend TRITON is not one of vLLM's" in err
    assert "TRITON_ATTN" in err


def test_a_skip_list_of_its_own_is_a_cell(bench):
    """``--skip boundary:0,19=turboquant_4bit_nc``: a TurboQuant cell whose
    engine gets that list (a layer with its own preset), after the named
    settings, under a file-safe key."""
    own = "boundary:0,19=turboquant_4bit_nc,2=turboquant_4bit_nc"
    cells = bench.plan_cells(
        ["smollm2_135m"], ["auto", "turboquant_3bit_nc"], [own, "boundary:0"]
    )
    assert [c.skip for c in cells] == ["default", "boundary:0", own]
    assert (
        cells[2].key == "smollm2_135m.turboquant_3bit_nc.boundary0-19-4bit_nc-2-4bit_nc"
    )
    assert re.fullmatch(r"[\w.-]+", cells[2].key)
    kw = bench.engine_kwargs(cells[2], 3)
    assert kw["kv_cache_dtype_skip_layers"] == [
        "boundary:0",
        "19=turboquant_4bit_nc",
        "2=turboquant_4bit_nc",
    ]


class FakeLLM:
    """vllm.LLM's surface the child uses: generate() and collective_rpc()."""

    def __init__(self, worker=None):
        self.worker = worker
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(
                    num_gpu_blocks=100, block_size=16, kv_cache_dtype_skip_layers=["0"]
                ),
                model_config=SimpleNamespace(max_model_len=2048),
            )
        )

    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            plp = None
            if params.prompt_logprobs is not None:
                plp = _prompt_logprobs(ids, [-1.0] * (len(ids) - 1))
            gen = [ids[-1] + 1] * params.max_tokens
            text = " 1234567." if ids[0] == 1 else " 7654321."
            outs.append(
                SimpleNamespace(
                    prompt_logprobs=plp,
                    outputs=[SimpleNamespace(token_ids=gen, text=text)],
                )
            )
        return outs

    def collective_rpc(self, fn):
        return [fn(self.worker)]


def _sampling_params(**kw):
    kw.setdefault("prompt_logprobs", None)
    return SimpleNamespace(**kw)


def test_child_phases_read_vllm_outputs(bench):
    child = import_benchmark("kvq_child")
    llm = FakeLLM()
    ppl = child.run_ppl(llm, _sampling_params, [[1, 2, 3], [4, 5, 6, 7]])
    assert ppl["tokens"] == 5 and ppl["ppl"] == pytest.approx(math.e)
    agr = child.run_agreement(llm, _sampling_params, [[1, 2], [3]])
    assert agr["outputs"] == [[3] * 64, [4] * 64]
    cases = [{"length": 4, "depth": 0.5, "number": "1234567"}] * 2
    needle = child.run_needle(llm, _sampling_params, [[1, 2], [2, 2]], cases)
    assert [a["hit"] for a in needle["answers"]] == [True, False]
    assert needle["recall_pct"] == 50.0
    cases = [{"answer": [7, 8, 9]}, {"answer": [5]}]
    answer = child.run_answer(llm, _sampling_params, [[1, 2], [2, 2]], cases)
    # The fake scores every prompt token at -1: the answer's tokens only.
    assert answer["nll"] == [3.0, 1.0] and answer["mean_nll"] == 2.0


def test_engine_facts_per_layer_and_unknown_with_reason(bench):
    child = import_benchmark("kvq_child")

    def layer(kv, window, name):
        backend = SimpleNamespace(get_name=lambda: name)
        return SimpleNamespace(
            kv_cache_dtype=kv,
            attn_backend=backend,
            impl=None,
            sliding_window=window,
            head_size=256,
            num_kv_heads=1,
            kv_cache=SimpleNamespace(dtype="torch.uint8", shape=(10, 16, 1, 200)),
        )

    def group(names, page, window=None):
        spec = SimpleNamespace(
            block_size=16, page_size_bytes=page, dtype="x", sliding_window=window
        )
        return SimpleNamespace(kv_cache_spec=spec, layer_names=names)

    ctx = {
        f"model.layers.{i}.self_attn.attn": layer(
            "turboquant_k8v4" if i == 5 else "auto",
            None if i == 5 else 512,
            "TURBOQUANT" if i == 5 else "FLASH_ATTN",
        )
        for i in range(6)
    }
    ctx["model.layers.0.mlp"] = SimpleNamespace()  # not attention: ignored
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context=ctx),
            kv_cache_config=SimpleNamespace(
                num_blocks=100,
                kv_cache_groups=[
                    # bf16: 16 tokens x 2 x 1 head x 256 x 2 bytes; a
                    # 392-byte TurboQuant slot over 512 elements.
                    group(
                        [f"model.layers.{i}.self_attn.attn" for i in range(5)],
                        16 * 1024,
                        512,
                    ),
                    group(["model.layers.5.self_attn.attn"], 16 * 392),
                ],
            ),
        )
    )
    facts = child.engine_facts(FakeLLM(worker))
    layer5 = facts["layers"]["model.layers.5.self_attn.attn"]
    assert layer5["bytes_per_token"] == 392
    # Five sliding layers hold 512 tokens of the 2,048 the full layer holds.
    cache = (5 * 512 * 1024 + 2048 * 392) * 8 / (5 * 512 * 512 + 2048 * 512)
    assert facts["kv_bits"] == {
        "quantized": 392 * 8 / 512,
        "cache": pytest.approx(cache),
        "context": 2048,
    }
    assert facts["layers_by_dtype"] == {
        "auto (FLASH_ATTN)": [0, 1, 2, 3, 4],
        "turboquant_k8v4 (TURBOQUANT)": [5],
    }
    assert (facts["quantized_layers"], facts["attention_layers"]) == (1, 6)
    assert facts["num_gpu_blocks"] == 100
    broken = child.engine_facts(FakeLLM(SimpleNamespace()))
    assert broken["layers"].startswith("unknown: AttributeError")


# A fake child: reads its args file (the harness's), behaves per cell.
_FAKE_CHILD = r"""
import json, sys, time
args = json.load(open(sys.argv[1]))
kind = args["kind"]
print("INFO GPU KV cache size: 123,456 tokens", flush=True)
if kind == "ok":
    res = {"key": args["key"], "timings": {"import_s": 1}, "errors": {},
           "ppl": {"ppl": 10.0}, "agreement": {"outputs": [[1]]},
           "needle": {"answers": []}, "answer": {"nll": []}}
    json.dump(res, open(args["result"], "w"))
elif kind == "fail":
    print("Traceback (most recent call last):")
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    print("RuntimeError: Engine core initialization failed. See root cause above.")
    sys.exit(3)
elif kind == "segv":
    import os, signal
    os.kill(os.getpid(), signal.SIGSEGV)
elif kind == "hang":
    print("RuntimeError: CUDA error: an illegal memory access was encountered")
    print("[kv-quality] still here", flush=True)
    time.sleep(60)
else:
    print("[kv-quality] engine_init: 1 s", flush=True)
    time.sleep(60)
"""


def test_run_cells_records_each_outcome(bench, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_FAKE_CHILD)
    kinds = dict(ok="ok", fail="fail", segv="segv", slow="slow", hang="hang", late="ok")
    cells = [bench.Cell("m", k, "default") for k in kinds]
    (tmp_path / "logs").mkdir()

    def prepare(cell):
        args = tmp_path / f"{cell.key}.args.json"
        result = tmp_path / f"{cell.key}.result.json"
        args.write_text(
            json.dumps({"key": cell.key, "kind": kinds[cell.kv], "result": str(result)})
        )
        return (
            [sys.executable, str(script), str(args)],
            tmp_path / "logs" / f"{cell.key}.log",
            result,
        )

    seen = []
    import time

    records = bench.run_cells(
        cells,
        prepare,
        gpus=["0", "1"],
        jobs=5,
        timeout=3.0,
        deadline_at=time.monotonic() + 6.0,
        on_done=seen.append,
        env_for=lambda gpu: {**os.environ, "CUDA_VISIBLE_DEVICES": gpu},
        poll=0.05,
    )
    by = {r["kv"]: r for r in records}
    assert by["ok"]["status"] == "ok" and by["ok"]["kv_tokens"] == 123456
    assert by["fail"]["status"] == "crash"
    assert by["fail"]["root_cause"].startswith(
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert by["segv"]["status"] == "crash (signal 11)"
    assert by["slow"]["status"] == "timeout"
    assert "last log line: [kv-quality] engine_init: 1 s" in by["slow"]["root_cause"]
    hang = by["hang"]["root_cause"]
    assert by["hang"]["status"] == "timeout" and "CUDA error: an illegal" in hang
    # Six cells, five at a time: the sixth starts when one ends.
    assert by["late"]["status"] == "ok"
    assert {r["gpu"] for r in records} == {"0", "1"}
    assert len(seen) == 6


def test_run_cells_deadline_kills_and_skips(bench, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_FAKE_CHILD)
    cells = [bench.Cell("m", f"slow{i}", "default") for i in range(3)]
    (tmp_path / "logs").mkdir()

    def prepare(cell):
        args = tmp_path / f"{cell.key}.args.json"
        args.write_text(
            json.dumps({"key": cell.key, "kind": "slow", "result": str(tmp_path / "r")})
        )
        return (
            [sys.executable, str(script), str(args)],
            tmp_path / "logs" / f"{cell.key}.log",
            tmp_path / "r",
        )

    import time

    records = bench.run_cells(
        cells, prepare, ["0"], jobs=2, timeout=60, deadline_at=time.monotonic() + 1.0,
        on_done=lambda r: None, env_for=lambda g: dict(os.environ), poll=0.05,
    )  # fmt: skip
    assert [r["status"] for r in records] == [
        "killed at deadline",
        "killed at deadline",
        "not run (deadline)",
    ]


def _checkpoint(tmp_path, model_type="llama"):
    d = tmp_path / "ck"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps({"model_type": model_type, "max_position_embeddings": 8192})
    )
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")
    return d


def _exit_code(bench, argv):
    try:
        return bench.main(argv)
    except SystemExit as e:  # argparse's own refusals
        return e.code


@pytest.mark.parametrize(
    "argv, why",
    [
        ("", "no --model given"),
        ("--model llama=/nowhere", "unknown model 'llama'"),
        ("--model smollm2_135m", "expected NAME=DIR"),
        ("--model smollm2_135m={tmp}/none", "has no config.json"),
        ("--model smollm2_135m={ck} --model smollm2_135m={ck}", "given twice"),
        ("--model gemma3_270m={ck}", "is a 'llama' checkpoint"),
        ("--model smollm2_135m={ck} --models gemma3_270m", "not among the --model"),
        (
            "--model smollm2_135m={ck} --corpus {tmp}/nope",
            "corpus file(s) not readable",
        ),
        (
            "--model smollm2_135m={ck} --corpus {tmp}/text.txt --jobs 0",
            "--jobs must be",
        ),
        ("--model smollm2_135m={ck} --corpus {tmp}/text.txt", "no GPU: CUDA_VISIBLE"),
        ("--model smollm2_135m={ck} --kv int4", "invalid choice: 'int4'"),
        (
            "--model smollm2_135m={ck} --needle-sample -1",
            "--needle-sample must be at least 0",
        ),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(
    bench, tmp_path, monkeypatch, capsys, argv, why
):
    ck = _checkpoint(tmp_path)
    (tmp_path / "text.txt").write_text(_text())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = [a.format(tmp=tmp_path, ck=ck) for a in argv.split()]
    assert _exit_code(bench, argv) == 2
    assert why in capsys.readouterr().err


def test_default_corpus_missing_exits_2(bench, tmp_path, monkeypatch, capsys):
    ck = _checkpoint(tmp_path)
    monkeypatch.setattr(bench.kvq_inputs, "DEFAULT_CORPUS", (str(tmp_path / "nope"),))
    assert _exit_code(bench, ["--model", f"smollm2_135m={ck}"]) == 2
    assert "no readable corpus" in capsys.readouterr().err


# A stand-in for vllm with the surface the child uses, so the harness's own
# parent and child code run end to end: auto scores every prompt token at
# logprob -2, TurboQuant at -2.1 and its greedy tokens leave auto's after 32
# on every other prompt; turboquant_3bit_nc fails to start.
_FAKE_VLLM = r"""
import types

class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, prompt_logprobs=None,
                 detokenize=True, ignore_eos=False):
        self.max_tokens, self.prompt_logprobs = max_tokens, prompt_logprobs

class _Lp:
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank

class LLM:
    def __init__(self, model, **kw):
        if kw["kv_cache_dtype"] == "turboquant_3bit_nc":
            raise ValueError("fake: no 3-bit today")
        self.kv = kw["kv_cache_dtype"]
        print("INFO [kv_cache_utils.py] GPU KV cache size: 98,304 tokens")
        cache = types.SimpleNamespace(
            num_gpu_blocks=6144, block_size=16,
            kv_cache_dtype_skip_layers=kw.get("kv_cache_dtype_skip_layers"))
        config = types.SimpleNamespace(
            cache_config=cache,
            model_config=types.SimpleNamespace(max_model_len=8192))
        self.llm_engine = types.SimpleNamespace(vllm_config=config)

    def generate(self, prompts, params, use_tqdm=True):
        lp = -2.0 if self.kv == "auto" else -2.1
        outs = []
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"]
            plp = None
            if params.prompt_logprobs is not None:
                plp = [None] + [{t: _Lp(lp, 1)} for t in ids[1:]]
            gen = [ids[-1]] * params.max_tokens
            if self.kv != "auto" and i % 2 and params.max_tokens > 32:
                gen[32:] = [0] * (params.max_tokens - 32)
            out = types.SimpleNamespace(token_ids=gen, text=" 1234567.")
            outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[out]))
        return outs

    def collective_rpc(self, fn):
        kv = self.kv
        backend = types.SimpleNamespace(get_name=lambda: "FAKE")
        layer = types.SimpleNamespace(kv_cache_dtype=kv, sliding_window=None,
                                      head_size=64, num_kv_heads=1,
                                      attn_backend=backend)
        ctx = {f"model.layers.{i}.self_attn.attn": layer for i in range(4)}
        # 100 bytes a token for TurboQuant, 256 (bf16) for auto.
        spec = types.SimpleNamespace(
            block_size=16, page_size_bytes=16 * (256 if kv == "auto" else 100))
        group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=list(ctx))
        runner = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(static_forward_context=ctx),
            kv_cache_config=types.SimpleNamespace(num_blocks=6144,
                                                  kv_cache_groups=[group]))
        return [fn(types.SimpleNamespace(model_runner=runner))]
"""


def test_main_end_to_end_with_a_fake_vllm(bench, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_FAKE_VLLM)
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]),
    )
    monkeypatch.setattr(bench, "load_tokenizer", lambda path: WordTokenizer())
    monkeypatch.setitem(bench.GRIDS, "smollm2_135m", bench.Grid(8192, (256, 512), 1))
    monkeypatch.setattr(
        bench,
        "detect_gpus",
        lambda: [{"index": "0", "name": "Fake GPU", "memory": "1 MiB"}],
    )
    (tmp_path / "text.txt").write_text(_text())
    out = tmp_path / "out"
    argv = [
        "--model", f"smollm2_135m={_checkpoint(tmp_path)}",
        "--kv", "auto", "turboquant_k8v4", "turboquant_3bit_nc",
        "--corpus", str(tmp_path / "text.txt"), "--out", str(out),
        "--gpus", "0", "--ppl-window", "100", "--ppl-windows", "3", "--needles", "1",
        "--timeout", "60", "--deadline", "120",
    ]  # fmt: skip
    assert bench.main(argv) == 1  # turboquant_3bit_nc failed
    printed = capsys.readouterr().out
    md = (out / "quality.md").read_text()
    assert f"[kv-quality] wrote {out}/quality.json, quality.md" in printed
    assert printed.rstrip().endswith(md.rstrip())  # the Markdown comes last
    result = json.loads((out / "quality.json").read_text())
    assert (
        result["meta"]["complete"]
        and result["meta"]["devices"][0]["name"] == "Fake GPU"
    )
    cells = {c["key"]: c for c in result["cells"]}
    assert list(cells) == [
        "smollm2_135m.auto.default",
        "smollm2_135m.turboquant_k8v4.default",
        "smollm2_135m.turboquant_k8v4.boundary0",
        "smollm2_135m.turboquant_3bit_nc.default",
        "smollm2_135m.turboquant_3bit_nc.boundary0",
    ]
    auto, tq = (
        cells["smollm2_135m.auto.default"],
        cells["smollm2_135m.turboquant_k8v4.boundary0"],
    )
    assert auto["status"] == tq["status"] == "ok"
    assert auto["ppl"]["ppl"] == pytest.approx(math.exp(2.0))
    assert auto["ppl"]["tokens"] == 3 * 99
    assert tq["ppl"]["ratio_to_auto"] == pytest.approx(math.exp(0.1))
    assert tq["agreement"]["pct"] == pytest.approx(75.0)
    assert tq["agreement"]["prompts_equal"] == 8
    assert tq["kv_tokens"] == 98304
    assert tq["facts"]["layers_by_dtype"] == {"turboquant_k8v4 (FAKE)": [0, 1, 2, 3]}
    assert tq["facts"]["skip_layers_resolved"] == ["boundary:0"]
    assert len(tq["needle"]["cases"]) == 2 * 5 and tq["needle"]["recall_pct"] == 0.0
    # The fake scores tokens at -2.0 (auto) and -2.1: each answer's tokens
    # cost 0.1 nat more apiece, on every case alike.
    answer_tokens = [len(case["answer"]) for case in tq["needle"]["cases"]]
    assert tq["answer"]["vs_auto"]["mean"] == pytest.approx(
        0.1 * sum(answer_tokens) / len(answer_tokens)
    )
    assert set(tq["timings"]) >= {
        "engine_init_s",
        "ppl_s",
        "agreement_s",
        "needle_s",
        "answer_s",
        "total_s",
    }
    bad = cells["smollm2_135m.turboquant_3bit_nc.default"]
    assert bad["status"] == "failed" and bad["rc"] == 3
    assert bad["root_cause"] == "ValueError: fake: no 3-bit today"
    assert "| turboquant_k8v4 | boundary:0 | 4/4 | 6.25 / 6.25 | 98,304 |" in md
    cause = "failed — ValueError: fake: no 3-bit today"
    assert f"- `smollm2_135m.turboquant_3bit_nc.default`: {cause}" in md
    import tarfile

    with tarfile.open(out / "logs.tar.gz") as tar:
        assert len(tar.getnames()) == 5


def test_kv_bits_count_every_byte_and_the_bf16_layers(bench):
    m = bench.measures

    def layer(kv, nbytes, window=None):
        # SmolLM2's shape: 3 KV heads x head_dim 64, 384 elements a token.
        return {
            "kv_cache_dtype": kv,
            "bytes_per_token": nbytes,
            "elements_per_token": 384,
            "sliding_window": window,
        }

    # 3bit_nc at head_dim 64: keys 24 + 2 bytes (norm), values 24 + 4
    # (scale, zero), 54 bytes a head: 3.375 bits per element.
    every = [layer("turboquant_3bit_nc", 3 * 54) for _ in range(30)]
    assert m.kv_bits_per_element(every, 8192) == {"quantized": 3.375, "cache": 3.375}
    # The default skip list keeps 4 of 30 layers at bf16: the cache spends
    # (26 x 3.375 + 4 x 16) / 30 bits.
    skipped = every[:26] + [layer("auto", 768) for _ in range(4)]
    bits = m.kv_bits_per_element(skipped, 8192)
    assert bits["quantized"] == 3.375
    assert bits["cache"] == pytest.approx((26 * 3.375 + 4 * 16) / 30)
    # A sliding layer holds its window only.
    slide = [layer("auto", 768, window=512), layer("turboquant_3bit_nc", 162)]
    got = m.kv_bits_per_element(slide, 4096)["cache"]
    assert got == pytest.approx((512 * 16 + 4096 * 3.375) / (512 + 4096))
    # A layer without its figures makes the whole answer unknown, not wrong.
    assert m.kv_bits_per_element([*every, layer("auto", None)], 8192) == {
        "quantized": None,
        "cache": None,
    }
