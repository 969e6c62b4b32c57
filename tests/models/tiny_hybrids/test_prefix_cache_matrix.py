# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of prefix_cache_matrix.py (issue 47, "First measure") and its
CPU plan (prefix_cache_plan.py): the cell plan, the requests and their
shared prefixes, the hit predictions, hit vs cold and the verdicts, the
tables. No engine is started here."""

import json
from types import SimpleNamespace

import pytest

from . import prefix_cache_matrix as pcm
from . import prefix_cache_plan as plan
from .tokenizer import SPECIAL_TOKENS

pytestmark = pytest.mark.cpu_test

CKPTS = {n: f"/c/{n}" for n in pcm.MODELS}
# Short suffixes of distinct first tokens: 1 warm + HITS hit requests.
SUFFIXES = [[10 + i, 20 + i, 30 + i] for i in range(1 + pcm.HITS)]


def _common(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
    )


# --- cells and engines --------------------------------------------------------


def test_cells_cover_the_issue_grid():
    cells = pcm.cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    hybrid = [c for c in cells if c.model in pcm.HYBRIDS]
    # 2 hybrids x 2 KV dtypes x none/mtp/ngram x all/align, and the split
    # pool's hybrid with MTP; dense: no MTP, no mode.
    assert len(hybrid) == 2 * 2 * 3 * 2 + 2 * 2
    assert {c.mode for c in hybrid} == {"all", "align"}
    dense = [c for c in cells if c.model == "qwen3_dense"]
    assert len(dense) == 2 * 2 and {c.mode for c in dense} == {pcm.DENSE_MODE}
    assert not any(c.spec == "mtp" for c in dense)
    assert {c.kv for c in cells} == {"auto", "turboquant_4bit_nc"}


def test_engine_plan_brings_cold_engines_first_and_all_cells_last():
    engines = pcm.engine_plan(pcm.cells())
    assert len(engines) == 32 + 18  # every cell + one cold per model/kv/spec
    modes = [e.mode for e in engines]
    assert modes == sorted(modes, key=lambda m: ["cold", "align", "-", "all"].index(m))
    for c in pcm.cells():
        assert c.cold() in engines
        assert not c.cold().prefix_caching and c.prefix_caching


@pytest.mark.parametrize("warm_order", [True, False])
def test_engines_wait_for_a_warm_compile_cache_unless_told_not_to(
    monkeypatch, warm_order
):
    from . import scheduling

    groups = {}

    def run_grouped(items, group, run, jobs):
        groups.update({c.name: group(c) for c in items})
        return []

    monkeypatch.setattr(scheduling, "run_grouped", run_grouped)
    engines = pcm.engine_plan(pcm.select(pcm.cells(), "qwen3_next.turboquant_4bit_nc"))
    args = pcm.parse_args(["out"] + ([] if warm_order else ["--no-warm-order"]))
    pcm.run_engines(engines, CKPTS, args, None, 0.0)
    if warm_order:  # per (model, kv), engines queue behind the first
        pairs = {(e.model, e.kv) for e in engines}
        assert len(set(groups.values())) == len(pairs) < len(engines)
    else:
        assert len(set(groups.values())) == len(engines) > 1


def test_only_narrows_and_keeps_what_a_cell_is_compared_with():
    chosen = pcm.select(pcm.cells(), "qwen3_5.turboquant_4bit_nc.mtp.align")
    assert [c.name for c in chosen] == ["qwen3_5.turboquant_4bit_nc.mtp.align"]
    names = [e.name for e in pcm.engine_plan(chosen)]
    assert names == [
        "qwen3_5.turboquant_4bit_nc.mtp.cold",
        "qwen3_5.auto.mtp.cold",  # TurboQuant's spread
        "qwen3_5.turboquant_4bit_nc.mtp.align",
    ]
    with pytest.raises(SystemExit, match="no cell name contains"):
        pcm.select(pcm.cells(), "gemma")
    both = pcm.select(pcm.cells(), "qwen3_5.auto.none.align,qwen3_next.auto.mtp.all")
    assert [c.name for c in both] == [
        "qwen3_next.auto.mtp.all",
        "qwen3_5.auto.none.align",
    ]


def test_engine_kwargs():
    longest = max(len(r.tokens) for r in pcm.flat(pcm.build_phases()))
    for cell in pcm.engine_plan(pcm.cells()):
        kw = pcm.engine_kwargs(cell, CKPTS)
        json.dumps(kw)
        assert "load_format" not in kw  # saved random weights, not dummy
        assert kw["enable_prefix_caching"] is cell.prefix_caching
        assert kw.get("mamba_cache_mode") == (
            cell.mode if cell.mode in pcm.MODES else None
        )
        assert kw["disable_log_stats"] is False  # the child reads the counters
        assert kw["kv_cache_memory_bytes"] == pcm.KV_CACHE_MEMORY_BYTES
        assert kw["enforce_eager"] and kw["kv_cache_dtype"] == cell.kv
        spec = kw.get("speculative_config")
        k = spec["num_speculative_tokens"] if spec else 0
        assert longest + pcm.NEW_TOKENS + k <= kw["max_model_len"]
        assert (spec or {}).get("method") == {
            "none": None,
            "mtp": "mtp",
            "ngram": "ngram",
        }[cell.spec]
        # The Qwen3.5-like checkpoints are vision-language ones, served as text.
        text_only = cell.model in {"qwen3_5", "qwen3_5_split"}
        assert kw.get("language_model_only", False) == text_only
    graphs = pcm.engine_kwargs(pcm.cells()[0], CKPTS, cg="FULL_AND_PIECEWISE")
    assert "enforce_eager" not in graphs
    assert graphs["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"


def test_checkpoints_get_room_for_an_8k_prefix():
    from . import checkpoints as ck

    for name in pcm.MODELS:
        spec = pcm.checkpoint_spec(name)
        assert spec.builder_kwargs["max_position_embeddings"] >= pcm.MAX_MODEL_LEN
        # Everything else (gains, MTP layers, overrides) as the other matrices.
        rest = {
            k: v
            for k, v in spec.builder_kwargs.items()
            if k != "max_position_embeddings"
        }
        assert rest == ck.MODELS[name].builder_kwargs
        assert spec.bigram_gain == ck.MODELS[name].bigram_gain


# --- requests -----------------------------------------------------------------


def test_requests_share_prefixes_of_the_right_length():
    phases = pcm.build_phases(suffixes=SUFFIXES)
    requests = pcm.flat(phases)
    # Per group: a warm-up phase of one request, then a phase of HITS requests.
    assert [len(p) for p in phases] == [1, pcm.HITS] * 4
    assert [p[0].group for p in phases[::2]] == ["2K", "8K", "2K-pre", "8K-pre"]
    special = set(SPECIAL_TOKENS.values())
    prefixes = {}
    for warm, hits in zip(phases[::2], phases[1::2]):
        (w,) = warm
        assert w.role == "warm" and all(h.role == "hit" for h in hits)
        n = w.prefix_len
        assert n == (2048 if w.group.startswith("2K") else 8192)
        prefix = w.tokens[:n]
        prefixes[w.group] = prefix
        if w.group.endswith("-pre"):
            assert w.tokens == prefix
        else:
            assert len(w.tokens) == n + pcm.WARM_SUFFIX_LEN
        for h in hits:
            assert h.tokens[:n] == prefix and h.prefix_len == n
            # Shares exactly the prefix with the warm-up and the others.
            assert _common(h.tokens, w.tokens) == n
            assert all(_common(h.tokens, o.tokens) == n for o in hits if o is not h)
        assert not special & set(prefix)
    # No group can hit another group's prefix.
    firsts = {p[:16] for p in prefixes.values()}
    assert len(firsts) == 4
    assert pcm.flat(pcm.build_phases(suffixes=SUFFIXES)) == requests  # seeded
    assert len(requests) == 4 * (1 + pcm.HITS)


def test_default_suffixes_are_the_screened_prompts():
    from .checkpoints import bigram_prompts

    phases = pcm.build_phases(prefix_lens=(64,), hits=2)
    hits = [r for r in pcm.flat(phases) if r.role == "hit"]
    assert [list(r.tokens[64:]) for r in hits[:2]] == bigram_prompts(3)[1:]
    warm = pcm.flat(phases)[0]
    assert list(warm.tokens[-len(bigram_prompts(1)[0]) :]) == bigram_prompts(1)[0]


def test_build_phases_needs_enough_suffixes():
    with pytest.raises(ValueError, match="need 5 suffixes"):
        pcm.build_phases(suffixes=SUFFIXES[:3])


# --- hit predictions ------------------------------------------------------------


@pytest.mark.parametrize(
    "length, block, eagle, positions",
    [
        # One step reaches the last boundary (the prompt fits the budget).
        (2560, 272, False, [2448]),
        (2048, 272, False, [1904]),
        # 8K + 512: the budget stops the first step at 8160, the second at
        # the last boundary.
        (8704, 80, False, [8160, 8640]),
        # MTP: the last boundary moves one block back.
        (8704, 80, True, [8160, 8560]),
        (2048, 416, True, [1248]),
        # A prompt shorter than a block keeps no state.
        (50, 80, False, []),
    ],
)
def test_aligned_state_positions(length, block, eagle, positions):
    assert pcm.aligned_state_positions(length, block, 8192, eagle) == positions


def test_predicted_cached():
    prefix = tuple(range(2048))
    long_warm = prefix + tuple(range(5000, 5512))
    hit = prefix + (7, 8, 9)
    # Dense: whole blocks of the common prefix.
    assert pcm.predicted_cached(long_warm, hit, 16, 8192, mamba=False) == 2048
    # Hybrid: the warm-up's only kept state lies past the shared prefix.
    assert pcm.predicted_cached(long_warm, hit, 272, 8192, mamba=True) == 0
    # Served alone first, the prefix leaves a state on its last boundary.
    assert pcm.predicted_cached(prefix, hit, 272, 8192, mamba=True) == 1904
    # MTP on a hybrid: the kept state moves back a block, attention does not.
    assert pcm.predicted_cached(prefix, hit, 416, 8192, mamba=True, eagle=True) == 1248
    warm = prefix + tuple(range(5000, 5512))  # 2,560 tokens: state at 2,304 - 288
    assert pcm.predicted_cached(warm, hit, 288, 8192, mamba=True, eagle=True) == 2016
    # MTP on a dense model (read, not measured): the last matching block drops.
    assert pcm.predicted_cached(prefix, hit, 16, 8192, mamba=False, eagle=True) == 2032
    # Never the hit request's last token.
    assert pcm.predicted_cached(prefix, prefix[:33], 16, 8192, mamba=False) == 32


def test_predicted_hits_per_group():
    phases = pcm.build_phases(suffixes=SUFFIXES)
    pred = pcm.predicted_hits(phases, 272, mamba=True)
    assert set(pred) == {"2K", "8K", "2K-pre", "8K-pre"}
    # The first hit request finds nothing the warm-up kept inside the prefix;
    # the others reuse the state it kept at its own last boundary (H200 run).
    assert pred["2K"] == [0] + [1904] * (pcm.HITS - 1)
    assert pred["8K"] == [8160] * pcm.HITS  # the budget's split point
    assert pred["2K-pre"] == [1904] * pcm.HITS
    mtp = pcm.predicted_hits(phases, 288, mamba=True, eagle=True)
    assert mtp["2K"] == [2016] * pcm.HITS  # measured: 2016 x 4
    assert mtp["8K"] == [8064] * pcm.HITS and mtp["8K-pre"] == [7776] * pcm.HITS
    mtp80 = pcm.predicted_hits(phases, 80, mamba=True, eagle=True)
    assert mtp80["2K"] == [0] + [1920] * (pcm.HITS - 1)  # measured: 0, 1920 x 3
    assert mtp80["8K"] == [8160] * pcm.HITS  # measured (read before: 0)
    dense = pcm.predicted_hits(phases, 16, mamba=False)
    assert dense["2K"] == [2048] * pcm.HITS and dense["8K"] == [8192] * pcm.HITS


def test_ideal_and_hit_block():
    r = pcm.Request("2K", "hit", 2048, tuple(range(2060)))
    assert pcm.ideal_cached(r, 272) == 1904
    assert pcm.ideal_cached(pcm.Request("x", "hit", 64, tuple(range(64))), 16) == 48
    groups = [{"block_size": 288}, {"block_size": 576}]
    assert pcm.hit_block({"groups": groups, "block_size": 288}) == 576
    assert pcm.hit_block({"block_size": 16}) == 16


# --- engine results -------------------------------------------------------------


def test_prefix_counters_sum_label_sets():
    metrics = [
        SimpleNamespace(name="vllm:prefix_cache_queries", value=100.0),
        SimpleNamespace(name="vllm:prefix_cache_queries_total", value=20.0),
        SimpleNamespace(name="vllm:prefix_cache_hits", value=64.0),
        SimpleNamespace(name="vllm:external_prefix_cache_hits", value=9.0),
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=3.0),
    ]
    assert pcm.prefix_counters(metrics) == {"queries": 120.0, "hits": 64.0}


PHASES = pcm.build_phases(prefix_lens=(64,), hits=2, suffixes=SUFFIXES[:3])
REQUESTS = pcm.flat(PHASES)  # 64.warm, 64.hit x2, 64-pre.warm, 64-pre.hit x2
OUT = [[(i * 7 + t) % 2048 for t in range(8)] for i in range(len(REQUESTS))]
ENGINE = {"block_size": 16, "groups": [{"type": "FullAttentionSpec", "block_size": 16,
                                        "page_size_bytes": 16384}]}  # fmt: skip


def _rec(outs=OUT, cached=None, hits=48.0, engine=ENGINE):
    counts = []
    for phase in PHASES:
        queries = float(sum(len(r.tokens) for r in phase))
        counts.append(
            {"queries": queries, "hits": hits if phase[0].role == "hit" else 0.0}
        )
    return {
        "rc": 0,
        "outputs": outs,
        "cached": cached or [0 if r.role == "warm" else 48 for r in REQUESTS],
        "phase_counts": counts,
        "engine": engine,
        "metrics": {},
        "wall": 30.0,
        "kv_tokens_log": 1000,
    }


def _changed(i, t, outs=OUT):
    outs = [list(o) for o in outs]
    outs[i][t] = (outs[i][t] + 1) % 2048
    return outs


def _records(cell, rec, cold=None, auto_cold=None):
    records = {cell.name: rec, cell.cold().name: cold or _rec()}
    if auto_cold is not None:
        records[cell.auto_cold().name] = auto_cold
    return records


def test_hit_stats_rates_ideal_and_prediction():
    cell = pcm.Cell("qwen3_dense", "auto", "none", pcm.DENSE_MODE)
    stats = pcm.hit_stats(cell, _rec(), PHASES)
    assert set(stats) == {"64", "64-pre"}
    s = stats["64"]
    assert s["queries"] == 2 * 67 and s["hits"] == 48.0
    assert s["rate"] == pytest.approx(2 * 48 / 134)
    assert s["counter_rate"] == pytest.approx(48 / 134)
    assert s["cached"] == [48, 48]
    assert s["ideal_rate"] == pytest.approx(2 * 64 / 134)
    assert s["predicted"] == [64, 64]


def test_compare_role_and_exact_verdict():
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    row = pcm.cell_row(cell, _records(cell, _rec()), PHASES)
    assert row["boot"] == "ok"
    assert row["hit_vs_cold"]["status"] == "exact"
    assert row["hit_vs_cold"]["prompts_exact"] == "4/4"
    assert row["warm_vs_cold"]["prompts_exact"] == "2/2"
    assert row["hit_vs_cold"]["labels"] == ["64.hit"] * 2 + ["64-pre.hit"] * 2
    assert row["verdict"] == "exact"


def test_a_hit_request_that_differs_from_cold_fails_auto():
    cell = pcm.Cell("qwen3_next", "auto", "mtp", "align")
    hit_index = [r.role for r in REQUESTS].index("hit") + 1  # second hit request
    row = pcm.cell_row(cell, _records(cell, _rec(_changed(hit_index, 5))), PHASES)
    assert row["hit_vs_cold"]["status"] == "DIFF 1@5"
    assert row["hit_vs_cold"]["agree"] == pytest.approx(1 - 1 / 32, abs=1e-4)
    assert row["verdict"] == "hit DIFF 1@5"
    # A warm-up request differing (caching on, no hit) is named as such.
    row = pcm.cell_row(cell, _records(cell, _rec(_changed(0, 2))), PHASES)
    assert row["verdict"] == "warm DIFF 0@2"


def test_tie_is_flagged_from_the_cold_engines_gaps():
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    cold = _rec()
    cold["gaps"] = [[1.0] * 8 for _ in REQUESTS]
    cold["gaps"][1][3] = 0.001
    row = pcm.cell_row(cell, _records(cell, _rec(_changed(1, 3)), cold), PHASES)
    assert row["hit_vs_cold"]["status"] == "DIFF 0@3 tie"


def test_turboquant_is_judged_against_its_own_spread():
    cell = pcm.Cell("qwen3_5", "turboquant_4bit_nc", "none", "align")
    hits = [i for i, r in enumerate(REQUESTS) if r.role == "hit"]
    run = _rec(_changed(hits[0], 0))  # 1 of 32 hit tokens differs
    # auto vs TurboQuant, both cold: 2 of 32 hit tokens differ.
    spread = _rec(_changed(hits[0], 1, _changed(hits[1], 1)))
    row = pcm.cell_row(cell, _records(cell, run, auto_cold=spread), PHASES)
    assert row["tq_spread"] == pytest.approx(30 / 32, abs=1e-4)
    assert row["verdict"] == "within TQ spread"
    worse = _rec(_changed(hits[0], 0, _changed(hits[1], 0, _changed(hits[2], 0))))
    row = pcm.cell_row(cell, _records(cell, worse, auto_cold=spread), PHASES)
    assert row["verdict"] == "OUTSIDE TQ spread"
    # Without the auto cold engine there is no spread: TurboQuant must be exact.
    row = pcm.cell_row(cell, _records(cell, run), PHASES)
    assert "tq_spread" not in row and row["verdict"].startswith("hit DIFF")


def test_boot_failures_no_hits_and_not_run():
    cell = pcm.Cell("qwen3_next", "turboquant_4bit_nc", "ngram", "all")
    crash = {"rc": 1, "wall": 9.0, "crash": "RuntimeError: boom",
             "root_cause": "AssertionError: block_size must be <= 8192"}  # fmt: skip
    row = pcm.cell_row(cell, _records(cell, crash), PHASES)
    assert row["boot"] == "failed" and row["verdict"] == "BOOT FAIL"
    assert row["root_cause"].startswith("AssertionError")
    row = pcm.cell_row(cell, {}, PHASES)
    assert row["verdict"] == "NOT RUN"
    skipped = {"rc": "skipped", "wall": 0, "crash": "NOT RUN (deadline)"}
    assert pcm.cell_row(cell, {cell.name: skipped}, PHASES)["verdict"] == "NOT RUN"
    late = {"rc": "timeout", "wall": 207.6, "crash": "TIMEOUT after 207s"}
    row = pcm.cell_row(cell, {**_records(cell, _rec()), cell.name: late}, PHASES)
    assert row["verdict"] == "TIMEOUT" and row["boot"] == "timeout"
    no_cold = {cell.name: _rec(), cell.cold().name: crash}
    assert pcm.cell_row(cell, no_cold, PHASES)["verdict"] == "NO COLD REF"
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    no_hits = _rec(hits=0.0, cached=[0] * len(REQUESTS))
    row = pcm.cell_row(cell, _records(cell, no_hits), PHASES)
    assert row["verdict"] == "exact (no hits)"


def test_hits_count_from_cached_tokens_when_the_counters_stay_at_zero():
    """The H200 run: engines with asynchronous scheduling left the prefix-cache
    counters at 0 while every hit request reported its cached tokens."""
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    row = pcm.cell_row(cell, _records(cell, _rec(hits=0.0)), PHASES)
    assert row["verdict"] == "exact"
    hit = row["hit_rates"]["64"]
    assert hit["rate"] == pytest.approx(2 * 48 / 134)
    assert hit["counter_rate"] == 0.0


def test_tables_render_every_row():
    rows = []
    for cell, rec in (
        (pcm.Cell("qwen3_next", "auto", "none", "align"), _rec()),
        (pcm.Cell("qwen3_5", "turboquant_4bit_nc", "mtp", "all"),
         {"rc": 1, "wall": 3.0, "crash": "X", "root_cause": "ValueError: no | way"}),
    ):  # fmt: skip
        plans = {cell.name: {"block_size": 16, "kv_tokens": 1000, "error": None}}
        rows.append(pcm.cell_row(cell, _records(cell, rec), PHASES, plans))
    text = pcm.format_table(rows)
    assert "1/2 cells exact" in text
    assert "FAIL: ValueError: no | way" in text
    assert "equal" in text  # plan vs engine: same block size and KV tokens
    md = pcm.format_markdown(rows, "header")
    lines = md.strip().splitlines()
    assert lines[0] == "header"
    columns = len(pcm.table_columns(("64", "64-pre")))
    assert len(lines) == 2 + 2 + len(rows)
    assert all(line.count("|") == columns + 1 for line in lines[2:])
    assert "no / way" in md  # a pipe in a cell cannot break the table


def test_hit_columns_are_the_runs_prefix_lengths():
    """The first trained run (2K and 7K prefixes) showed its 7K hits as "-":
    the columns were 2K and 8K whatever the run served."""
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    row = pcm.cell_row(cell, _records(cell, _rec()), PHASES)
    head = pcm.format_table([row]).splitlines()[0]
    assert "hit 64 " in head and "hit 64-pre" in head
    assert "hit 8K" not in head
    assert "48, pred 64" in pcm.format_table([row])


def test_preemption_budgets_reach_the_cells_not_the_cold_engines():
    hybrid = pcm.Cell("qwen3_next", "auto", "none", "align")
    budgets = {hybrid.name: 21_882_586}
    kwargs = pcm.engine_kwargs(hybrid, CKPTS, kv_bytes=budgets[hybrid.name])
    assert kwargs["kv_cache_memory_bytes"] == budgets[hybrid.name]
    args = SimpleNamespace(
        cg="NONE", prefix_lens=[64], hits=2, warm_suffix=8, new_tokens=8,
        kv_budgets=budgets,
    )  # fmt: skip
    engine = pcm.child_args(hybrid, CKPTS, args)["engine"]
    assert engine["kv_cache_memory_bytes"] == budgets[hybrid.name]
    cold = pcm.child_args(hybrid.cold(), CKPTS, args)["engine"]
    assert cold["kv_cache_memory_bytes"] == pcm.KV_CACHE_MEMORY_BYTES


def test_preemptions_are_counted_and_shown():
    metrics = [
        SimpleNamespace(name="vllm:num_preemptions", value=3.0),
        SimpleNamespace(name="vllm:num_preemptions_total", value=2.0),
        SimpleNamespace(name="vllm:num_requests_running", value=5.0),
    ]
    assert pcm.preemptions(metrics) == 5
    cell = pcm.Cell("qwen3_next", "auto", "none", "align")
    budgets = {cell.name: 1 << 20}
    plans = {cell.name: {"block_size": 16, "kv_tokens": 1000, "error": None}}
    row = pcm.cell_row(
        cell, _records(cell, {**_rec(), "preemptions": 4}), PHASES, plans, budgets
    )
    assert row["verdict"] == "exact" and row["preemptions"] == 4
    assert "plan" not in row  # planned at the matrix's budget, not this one
    assert "| 4 |" in pcm.format_markdown([row])
    simulated = {**_rec(), "preemptions": 4, "preempt_predicted": [4, 5, 4]}
    row = pcm.cell_row(cell, _records(cell, simulated), PHASES, plans, budgets)
    assert "| 4 (sim 4/5/4) |" in pcm.format_markdown([row])
    row = pcm.cell_row(
        cell, _records(cell, {**_rec(), "preemptions": 0}), PHASES, plans, budgets
    )
    assert row["verdict"] == "exact (no preemption)"


def test_parse_args():
    args = pcm.parse_args(["out"])
    assert args.prefix_lens == list(pcm.PREFIX_LENS) and args.deadline == pcm.DEADLINE
    assert args.jobs == 12 and args.plan and args.cg == "NONE" and not args.preempt
    assert pcm.parse_args(["out", "--preempt"]).preempt
    assert pcm.parse_args(["out", "--deadline", "0", "--no-plan"]).deadline is None
    with pytest.raises(SystemExit):
        pcm.parse_args(["out", "--prefix-lens", "9000"])
    with pytest.raises(SystemExit):
        pcm.parse_args([])
    with pytest.raises(SystemExit):
        pcm.parse_args(["out", "--preempt-sim", "sim.json"])  # without --preempt


def test_budgets_simulated_elsewhere_must_be_for_this_run(tmp_path, capsys):
    argv = ["out", "--preempt", "--only", "qwen3_5_split.auto", "--hits", "8"]
    args = pcm.parse_args([*argv, "--preempt-sim", str(tmp_path / "sim.json")])
    settings = pcm.run_settings(8, pcm.NEW_TOKENS, pcm.WARM_SUFFIX_LEN,
                                       list(pcm.PREFIX_LENS))  # fmt: skip
    chosen = pcm.select(pcm.cells(), "qwen3_5_split.auto")
    names = [c.name for c in chosen]
    budget = {"kv_bytes": 1 << 26, "preemptions": [3, 4, 3]}
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"settings": settings,
                               "cells": {n: budget for n in names}}))  # fmt: skip
    assert pcm.read_preemption_sim(sim, args, chosen) == {n: budget for n in names}

    def refused(data) -> str:
        sim.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(SystemExit) as e:
            pcm.read_preemption_sim(sim, args, chosen)
        assert e.value.code == 2
        return capsys.readouterr().out

    other = {**settings, "new_tokens": 32, "hits": 4}
    out = refused({"settings": other, "cells": {n: budget for n in names}})
    assert "hits 4 here 8" in out and "new_tokens 32 here" in out
    out = refused({"settings": settings, "cells": {names[0]: budget}})
    assert f"no budget for {names[1]}" in out
    assert "not preemption_sim's output" in refused("{}")


# --- CPU plan -------------------------------------------------------------------


def test_plan_cells():
    tiny = plan.plan_cells(tiny_only=True)
    assert tiny == pcm.cells()
    with_cold = plan.plan_cells(tiny_only=True, with_cold=True)
    assert len(with_cold) == len(tiny) + 18
    full = plan.plan_cells()
    assert {c.model for c in full} == set(plan.MODELS)
    assert plan.budget("qwen3_next") == (pcm.KV_CACHE_MEMORY_BYTES, pcm.MAX_MODEL_LEN)
    assert plan.budget("Qwen3-4B")[1] == 40960  # its own context is shorter


def test_plan_first_line():
    err = "1 validation error for ModelConfig\n  Value error, too long [type=x]\n more"
    assert plan._first_line(err) == (
        "1 validation error for ModelConfig: Value error, too long [type=x]"
    )
    assert plan._first_line("ValueError: a\nb") == "ValueError: a"


def test_plan_markdown():
    on = {
        "name": "qwen3_next.auto.none.align",
        "model": "qwen3_next",
        "kv": "auto",
        "spec": "none",
        "mode": "align",
        "error": None,
        "mode_effective": "align",
        "attention_block_sizes": [80],
        "mamba_block_size": 80,
        "page_size_bytes": 163840,
        "mamba_state_bytes": 137216,
        "attention_bytes_per_token": [2048],
        "padding_fraction": 0.1219,
        "kv_tokens": 123736,
        "predicted_cached": {"2K": 0, "8K": 8160, "2K-pre": 2000, "8K-pre": 8160},
    }
    off = {**on, "name": "qwen3_next.auto.none.cold", "mode": "cold"}
    off.update(kv_tokens=126855, predicted_cached=None)
    refused = {**on, "name": "qwen3_next.auto.mtp.all", "spec": "mtp", "mode": "all"}
    refused["error"] = "engine configuration: NotImplementedError: x"
    lines = plan.markdown_lines([on, off, refused])
    assert len(lines) == 2 + 2  # the cold row is a column, not a row
    assert all(line.count("|") == len(plan.MD_COLUMNS) + 1 for line in lines)
    assert "123,736 | 126,855 | 0 / 8,160 | 2,000 / 8,160 | not yet run" in lines[2]
    assert "refused: engine configuration: NotImplementedError: x" in lines[3]


def test_plan_drives_the_planner_with_prefix_caching(tmp_path):
    """One real plan: the planner's request takes prefix caching and the
    Mamba cache mode, and vLLM turns 'all' into 'align' for Qwen3-Next."""
    dirs = plan.write_configs(tmp_path, {"qwen3_next"})
    align = plan.plan_cell(
        pcm.Cell("qwen3_next", "turboquant_4bit_nc", "none", "align"),
        dirs["qwen3_next"],
    )
    assert align["error"] is None, align["error"]
    assert align["enable_prefix_caching"] and align["mode_effective"] == "align"
    assert align["mamba_block_size"] == align["block_size"] >= 16
    assert align["kv_tokens"] > 0
    every = plan.plan_cell(
        pcm.Cell("qwen3_next", "turboquant_4bit_nc", "none", "all"), dirs["qwen3_next"]
    )
    assert every["mode_effective"] == "align"
    cold = plan.plan_cell(
        pcm.Cell("qwen3_next", "turboquant_4bit_nc", "none", "cold"), dirs["qwen3_next"]
    )
    assert not cold["enable_prefix_caching"] and cold["mode_effective"] == "none"
    assert cold["kv_tokens"] > align["kv_tokens"]  # align keeps 2 states per request


# --- trained checkpoints (--trained) -------------------------------------------


def _trained_dir(tmp_path, positions=8192, nested=False):
    """A converted checkpoint's config.json, as SmolLM2-135M's (8,192
    positions) or, ``nested``, with the positions in its text config."""
    path = tmp_path / "smollm2_135m"
    path.mkdir(parents=True)
    config = (
        {"text_config": {"max_position_embeddings": positions}}
        if nested
        else {"max_position_embeddings": positions}
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_trained_checkpoint_adds_its_cells_served_in_bf16_within_its_positions(
    tmp_path,
):
    path = _trained_dir(tmp_path)
    args = pcm.parse_args(
        ["out", "--trained", f"smollm2={path}", "--prefix-lens", "2048,7168"]
    )
    assert args.trained == {"smollm2": path}
    mine = [c for c in pcm.cells(tuple(args.trained)) if c.model == "smollm2"]
    assert [c.name for c in mine] == [
        "smollm2.auto.none.-", "smollm2.auto.ngram.-",
        "smollm2.turboquant_4bit_nc.none.-", "smollm2.turboquant_4bit_nc.ngram.-",
    ]  # fmt: skip
    assert pcm.cells() == [c for c in pcm.cells(("smollm2",)) if c.model != "smollm2"]
    longest = max(len(r.tokens) for r in pcm.flat(pcm.build_phases((2048, 7168))))
    for cell in pcm.engine_plan(mine):
        kw = pcm.engine_kwargs(cell, {**CKPTS, **args.trained})
        assert (kw["model"], kw["dtype"], kw["max_model_len"]) == (
            path,
            "bfloat16",
            8192,
        )
        assert longest + pcm.NEW_TOKENS + 3 <= kw["max_model_len"]
        assert "language_model_only" not in kw and "mamba_cache_mode" not in kw
    # Positions past the matrix's own: the matrix's max_model_len.
    nested = _trained_dir(tmp_path / "g", positions=32768, nested=True)
    assert pcm.model_max_len(nested) == pcm.MAX_MODEL_LEN


def test_a_trained_cell_has_no_bigram_context_column():
    cell = pcm.Cell("smollm2", "auto", "none", pcm.DENSE_MODE)
    row = pcm.cell_row(cell, _records(cell, _rec()), PHASES)
    assert row["verdict"] == "exact" and "ctx" not in row
    tiny = pcm.Cell("qwen3_dense", "auto", "none", pcm.DENSE_MODE)
    assert "ctx" in pcm.cell_row(tiny, _records(tiny, _rec()), PHASES)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--trained", "smollm2"], "expected NAME=DIR"),
        (["--trained", "qwen3_dense={path}"], "names a tiny checkpoint"),
        (["--trained", "smollm2={path}/none"], "holds no config.json"),
        ([], "the longest request takes 8776 positions and smollm2 serves 8192"),
        (["--prefix-lens", "2048,7168", "--preempt"], "--trained with --preempt"),
    ],
)
def test_trained_checkpoints_that_cannot_run_are_refused_by_name(
    tmp_path, capsys, extra, says
):
    path = _trained_dir(tmp_path)
    given = [] if extra[:1] == ["--trained"] else ["--trained", f"smollm2={path}"]
    argv = ["out", *given, *(a.format(path=path) for a in extra)]
    with pytest.raises(SystemExit) as bad:
        pcm.parse_args(argv)
    assert bad.value.code == 2
    assert says in capsys.readouterr().err


# A trained checkpoint's cells: text prompts and logit drift (logit_flips).


def _top2(outs, logit=20.0, gap=4.0):
    """Top two raw logits per generated token: the chosen token, then
    another ``gap`` below."""
    return [[[[t, logit], [t + 1, logit - gap]] for t in o] for o in outs]


def _trained(outs=OUT, top2=None):
    rec = _rec(outs)
    rec["top_logits"] = top2 or _top2(outs)
    return rec


def test_trained_cells_pass_a_flip_at_a_bf16_tie():
    """bf16 logits of 20 are 0.125 apart; a hit that moved them by a step
    flips a token whose top two were one step apart, as the first trained
    run (token-id prompts) did in about a third of its requests."""
    cell = pcm.Cell("smollm2", "auto", "none", pcm.DENSE_MODE)
    changed = _changed(1, 3)
    cold_top2 = _top2(OUT)
    cold_top2[1][3] = [[OUT[1][3], 20.0], [changed[1][3], 19.875]]
    run_top2 = _top2(changed, logit=20.125)
    run_top2[1][3] = [[changed[1][3], 20.0], [OUT[1][3], 19.875]]
    row = pcm.cell_row(
        cell,
        _records(cell, _trained(changed, run_top2), cold=_trained(OUT, cold_top2)),
        PHASES,
    )
    flips = row["hit_flips"]
    assert flips["drift_ulps_max"] == 1.0
    assert flips["flips"] == [{"request": 1, "at": 3, "margin_ulps": 2.0}]
    assert row["verdict"] == "rounding flips"
    assert "1.0/1.0, flips 1 (2)" in pcm.format_table([row])


@pytest.mark.parametrize(
    ("second", "drift_logit", "why"),
    [
        (None, 20.125, "the new token was not the cold engine's second choice"),
        (19.875, 23.0, "the logits drifted by 24 steps: no rounding"),
    ],
)
def test_trained_cells_fail_a_flip_rounding_does_not_explain(second, drift_logit, why):
    cell = pcm.Cell("smollm2", "auto", "none", pcm.DENSE_MODE)
    changed = _changed(1, 3)
    cold_top2 = _top2(OUT)
    if second is not None:
        cold_top2[1][3] = [[OUT[1][3], 20.0], [changed[1][3], second]]
    run_top2 = _top2(changed, logit=drift_logit)
    run_top2[1][3] = [[changed[1][3], 20.0], [OUT[1][3], 19.875]]
    row = pcm.cell_row(
        cell,
        _records(cell, _trained(changed, run_top2), cold=_trained(OUT, cold_top2)),
        PHASES,
    )
    assert row["verdict"].startswith("hit DIFF"), why


def test_trained_phases_are_text_documents():
    """Every prefix starts with the tokenizer's special prefix and is exactly
    as long as asked; groups differ from their second token on (no group hits
    another's blocks); messages are corpus passages of SUFFIX_TOKENS."""
    from benchmarks.quality.kvq_inputs import Corpus
    from tests.models.real_weights.prefix_prompts import SUFFIX_TOKENS, CorpusPrompts

    ids = list(range(1000, 6000))
    ends = [i % 50 == 49 for i in range(len(ids))]
    text = CorpusPrompts(Corpus(text="", ids=ids, ends=ends), special=[2])
    phases = pcm.build_phases((256, 512), hits=3, warm_suffix_len=128, text=text)
    requests = pcm.flat(phases)
    assert [r.label for r in requests][:2] == ["256.warm", "256.hit"]
    for r in requests:
        assert r.tokens[0] == 2 and all(t >= 1000 for t in r.tokens[1:])
    hits = [r for r in requests if r.role == "hit"]
    assert all(len(r.tokens) == r.prefix_len + SUFFIX_TOKENS for r in hits)
    warm = next(r for r in requests if r.group == "256")
    assert len(warm.tokens) == 256 + 128
    starts = {r.tokens[1] for r in requests if r.role == "warm"}
    assert len(starts) == 4
    # Each passage starts a sentence (after a token that ends one).
    assert all((r.tokens[1] - 1000) % 50 == 0 for r in requests)


def test_trained_cells_place_a_three_way_tie():
    """The second trained run kept two logits: 3 of Gemma 3's flips changed to
    the cold engine's third token, three tokens at one bf16 value."""
    cell = pcm.Cell("gemma3", "auto", "none", pcm.DENSE_MODE)
    changed = _changed(1, 3)
    a, b, x = OUT[1][3], changed[1][3], 5000
    cold_top = _top2(OUT)
    cold_top[1][3] = [[a, 20.0], [x, 20.0], [b, 20.0]]
    run_top = _top2(changed)
    run_top[1][3] = [[b, 20.0], [a, 20.0], [x, 20.0]]
    row = pcm.cell_row(
        cell,
        _records(cell, _trained(changed, run_top), cold=_trained(OUT, cold_top)),
        PHASES,
    )
    assert row["hit_flips"]["flips"][0]["margin_ulps"] == 0.0
    assert row["verdict"] == "rounding flips"


def test_trained_turboquant_cells_show_turboquants_own_drift():
    """Beside a TurboQuant hit's drift from its cold engine, how far that cold
    engine's logits sit from auto's on the same requests."""
    cell = pcm.Cell("smollm2", "turboquant_4bit_nc", "none", pcm.DENSE_MODE)
    records = _records(
        cell,
        _trained(OUT, _top2(OUT, logit=20.125)),
        cold=_trained(OUT, _top2(OUT, logit=20.25)),
        auto_cold=_trained(OUT),
    )
    row = pcm.cell_row(cell, records, PHASES)
    assert row["hit_flips"]["drift_ulps_max"] == 1.0
    assert row["tq_flips"]["drift_ulps_max"] == 2.0
    assert row["verdict"] == "exact"
    assert "1.0/1.0" in pcm.format_table([row]) and "2.0/2.0" in pcm.format_table([row])
