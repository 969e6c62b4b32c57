# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of spec_decode_matrix.py: cells, engine arguments, metrics,
comparison, table, and the injected faults (hook points and what they do)."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from . import spec_decode_matrix as sdm

pytestmark = pytest.mark.cpu_test

CKPTS = {
    "qwen3_next": "/c/qwen3_next",
    "qwen3_5": "/c/qwen3_5",
    "qwen3_dense": "/c/qwen3_dense",
    "qwen3_dense_draft": "/c/qwen3_dense_draft",
    "self_draft": "/c/qwen3_dense_copy",
}


def test_quick_covers_the_required_cells():
    quick = {c.key for c in sdm.QUICK_CELLS}
    required = [
        *(
            f"qwen3_next.{kv}.mtp3.{cg}"
            for kv in ("auto", "turboquant_4bit_nc")
            for cg in ("NONE", "FULL_AND_PIECEWISE")
        ),
        "qwen3_5.turboquant_4bit_nc.mtp1.FULL_AND_PIECEWISE",
        "qwen3_dense.turboquant_4bit_nc.ngram3.FULL_AND_PIECEWISE",
        "hybrid_draft.turboquant_4bit_nc.draft3.FULL_AND_PIECEWISE",
    ]
    assert set(required) <= quick
    assert set(quick) <= {c.key for c in sdm.full_cells()}


def test_full_matrix_axes():
    cells = sdm.full_cells()
    assert {c.kv for c in cells} == set(sdm.KV_DTYPES)
    assert {c.cg for c in cells} == set(sdm.CG_MODES)
    assert {c.spec for c in cells} == {"mtp1", "mtp3", "ngram3", "draft3"}
    # 3 + 2 + 1 + 2 specs on four models + 1 (hybrid + draft), 4 kv x 3 modes.
    assert len(cells) == 9 * 12
    # hybrid + draft compares against the hybrid main's own reference.
    c = sdm.Cell("hybrid_draft", "auto", "draft3", "NONE")
    assert c.reference() == sdm.Cell("qwen3_next", "auto", "none", "NONE")


def test_select_filters_and_rejects_bad_filters():
    cells = sdm.select(sdm.full_cells(), "model=qwen3_next,cg=NONE|PIECEWISE")
    assert cells and all(
        c.model == "qwen3_next" and c.cg in ("NONE", "PIECEWISE") for c in cells
    )
    with pytest.raises(SystemExit, match="field=value"):
        sdm.select(sdm.full_cells(), "mode=NONE")


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["out", "--quick"], {"quick": True, "inject": None, "timeout": 240}),
        (["out", "--inject", "gdn-offset-zero"], {"inject": "gdn-offset-zero"}),
        (["out", "--speed"], {"speed": True, "timeout": 300}),
        (["out", "--speed", "--modes", "NONE"], {"modes": ["NONE"]}),
        (["out", "--timeout", "99"], {"timeout": 99, "jobs": 16, "gain": {}}),
        (["out", "--gain", "qwen3_next=0.05"], {"gain": {"qwen3_next": 0.05}}),
        (["--table", "a.json", "b.json"], {"table": ["a.json", "b.json"]}),
    ],
)
def test_parse_args(argv, expect):
    args = sdm.parse_args(argv)
    for k, v in expect.items():
        assert getattr(args, k) == v


def test_parse_args_rejects_unknown_fault_and_missing_outdir():
    with pytest.raises(SystemExit):
        sdm.parse_args(["out", "--inject", "nope"])
    with pytest.raises(SystemExit):
        sdm.parse_args(["--quick"])
    with pytest.raises(SystemExit):
        sdm.parse_args(["out", "--speed", "--modes", "FULL"])


def test_engine_kwargs():
    none = sdm.engine_kwargs(sdm.Cell("qwen3_5", "auto", "none", "NONE"), CKPTS)
    assert none["enforce_eager"] and "speculative_config" not in none
    assert none["language_model_only"] and not none["disable_log_stats"]
    assert none["dtype"] == "float16"  # checkpoints.MATRIX_DTYPE
    bf16 = sdm.engine_kwargs(
        sdm.Cell("qwen3_5", "auto", "none", "NONE"), CKPTS, dtype="bfloat16"
    )
    assert bf16["dtype"] == "bfloat16"
    full = sdm.engine_kwargs(
        sdm.Cell("qwen3_next", "turboquant_4bit_nc", "mtp3", "FULL_AND_PIECEWISE"),
        CKPTS,
    )
    assert "enforce_eager" not in full
    assert full["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert full["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert full["kv_cache_dtype"] == "turboquant_4bit_nc"
    hybrid = sdm.engine_kwargs(
        sdm.Cell("hybrid_draft", "auto", "draft3", "PIECEWISE"), CKPTS
    )
    assert hybrid["model"] == CKPTS["qwen3_next"]
    assert hybrid["speculative_config"]["model"] == CKPTS["qwen3_dense_draft"]
    dense = sdm.engine_kwargs(sdm.Cell("qwen3_dense", "auto", "draft3", "NONE"), CKPTS)
    assert dense["speculative_config"]["model"] == CKPTS["self_draft"]
    # Every engine argument must survive the JSON hop to the child.
    json.dumps(full)


def test_engine_kwargs_are_accepted_by_vllm(tmp_path):
    """Every argument the children pass builds a VllmConfig (CPU platform).

    Cells that 0.20.2 itself refuses at config time (TurboQuant on GDN
    hybrids, fixed by patch 0005) are left out so this passes on pristine and
    patched alike; on the patched tree all 132 engines of the full matrix and
    the 3 speed engines pass (checked by hand against /work/dev-spec)."""
    from vllm.engine.arg_utils import EngineArgs

    from .checkpoints import MODELS, write_config

    ckpts = {n: str(write_config(n, tmp_path / n)) for n in MODELS}
    ckpts["self_draft"] = ckpts["qwen3_dense"]
    cells = [
        c
        for c in sdm.full_cells()
        if c.cg != "PIECEWISE" and (c.kv == "auto" or c.model == "qwen3_dense")
    ]
    seen = set()
    for cell in cells:
        for c in (cell.reference(), cell):
            if c.key in seen:
                continue
            seen.add(c.key)
            config = EngineArgs(**sdm.engine_kwargs(c, ckpts)).create_engine_config()
            assert config.cache_config.cache_dtype == c.kv
            method = (sdm.SPECS[c.spec] or {}).get("method")
            assert getattr(config.speculative_config, "method", None) == method


def test_check_configs_cli(tmp_path, capsys):
    argv = [str(tmp_path), "--check-configs", "--only", "model=qwen3_dense,cg=NONE"]
    assert sdm.main(argv) == 0
    # 2 specs x 4 KV dtypes + 4 shared references.
    assert "12/12 engine configs build" in capsys.readouterr().out


def test_spec_metrics_histogram():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    metrics = [
        Counter("vllm:spec_decode_num_drafts", {}, 10),
        Counter("vllm:spec_decode_num_draft_tokens", {}, 30),
        Counter("vllm:spec_decode_num_accepted_tokens", {}, 17),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, [8, 6, 3]),
        Gauge("vllm:kv_cache_usage_perc", {}, 0.1),
    ]
    m = sdm.spec_metrics(metrics)
    # drafts with exactly 0, 1, 2, 3 accepted
    assert m["histogram"] == [2, 2, 3, 3]
    assert sum(j * n for j, n in enumerate(m["histogram"])) == 17
    assert m["mean_accept_len"] == pytest.approx(2.7)
    assert sdm.spec_metrics([]) == {}


def _rec(outputs, gaps=None):
    rec = {
        "outputs": outputs,
        "metrics": {"histogram": [1, 0, 3], "mean_accept_len": 2.5},
    }
    if gaps is not None:
        rec["gaps"] = gaps
    return rec


def test_compare():
    ref = _rec([[1, 2, 3, 4], [5, 6, 7, 8]], gaps=[[1.0, 1.0, 0.001, 1.0]] * 2)
    row = sdm.compare(ref, _rec([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert row["status"] == "exact" and row["prompts_exact"] == "2/2"
    assert row["histogram"] == [1, 0, 3]
    row = sdm.compare(ref, _rec([[1, 2, 3, 4], [5, 9, 7, 8]]))
    assert row["status"] == "DIFF 1@1" and row["first_diffs"] == [(1, 1)]
    # A first divergence at a near-tie of the reference is marked as such.
    row = sdm.compare(ref, _rec([[1, 2, 0, 4], [5, 6, 7, 8]]))
    assert row["status"] == "DIFF 0@2 tie"
    # A shorter output is a divergence too.
    assert sdm.compare(ref, _rec([[1, 2, 3], [5, 6, 7, 8]]))["status"] == "DIFF 0@3"
    row = sdm.compare(ref, {"crash": "RuntimeError: boom"})
    assert row["status"] == "CRASH(spec)" and row["crash"] == "RuntimeError: boom"


def test_context_positions():
    from .checkpoints import successor_map

    succ = successor_map()
    follow = [succ[5], succ[succ[5]]]
    assert sdm.context_positions([[1, 5]], [follow]) == 0
    assert sdm.context_positions([[1, 5]], [[follow[0], follow[0]]]) == 1
    ref = _rec([[succ[5], succ[succ[5]]]])
    assert sdm.compare(ref, ref, [[5]])["ctx_positions"] == 0


def test_crash_text():
    log = "INFO x\nTraceback (most recent call last):\n  File ...\n"
    log += "RuntimeError: Cannot copy between CPU and CUDA tensors during capture\n"
    log += "  more context\n"
    assert sdm.crash_text(log).startswith("RuntimeError: Cannot copy between")
    assert sdm.crash_text("torch.OutOfMemoryError: CUDA out of memory. x") == (
        "torch.OutOfMemoryError: CUDA out of memory. x"
    )
    assert sdm.crash_text("") == "no output"
    wrapped = (
        "[rank0]: NotImplementedError: TurboQuant KV cache is not supported\n"
        "(EngineCore pid=12) RuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}\n"
    )
    assert sdm.crash_text(wrapped) == (
        "NotImplementedError: TurboQuant KV cache is not supported"
    )


def test_table_from_result_json(tmp_path, capsys):
    rows = [
        {
            "model": "qwen3_next",
            "kv": "turboquant_4bit_nc",
            "spec": "mtp3",
            "cg": "FULL_AND_PIECEWISE",
            "status": "exact",
            "prompts_exact": "12/12",
            "distinct_min": 61,
            "histogram": [3, 1, 2, 90],
            "mean_accept_len": 3.86,
        },
        {
            "model": "qwen3_dense",
            "kv": "auto",
            "spec": "ngram3",
            "cg": "NONE",
            "status": "CRASH(spec)",
            "crash": "RuntimeError: Cannot copy between CPU and CUDA tensors",
        },
    ]
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps({"rows": rows}))
    speed = tmp_path / "speed.json"
    speed.write_text(
        json.dumps(
            {
                "rows": [
                    {"cg": "FULL_AND_PIECEWISE", "out_tok_s": 1999.0, "wall": 1},
                    {"cg": "NONE", "crash": "ValueError: x", "wall": 1},
                ]
            }
        )
    )
    assert sdm.main(["--table", str(path), str(speed)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == [
        "model", "kv", "spec", "cg", "status", "exact", "dist", "ctx", "accept",
        "hist", "len",
    ]  # fmt: skip
    assert "4bit_nc" in lines[1] and "full+pw" in lines[1] and "3,1,2,90" in lines[1]
    assert "3.86" in lines[1]
    assert "CRASH(spec)" in lines[2]
    assert "qwen3_dense.auto.ngram3.NONE: RuntimeError: Cannot copy" in out
    assert "1/2 cells exact" in out
    assert "1999.0 out tok/s" in out and "CRASH ValueError: x" in out
    assert "not meaningful" in out


def test_fault_hook_points_exist_in_installed_vllm():
    """The FAULTS table names attributes that exist: apply_fault would fail
    loudly otherwise (checked without patching anything)."""
    import importlib

    for name, targets in sdm.FAULTS.items():
        for module, cls_name, attr, _ in targets:
            cls = getattr(importlib.import_module(module), cls_name)
            assert attr in vars(cls), f"{name}: {cls_name}.{attr}"


def test_apply_fault_names_a_moved_hook(monkeypatch):
    monkeypatch.setitem(
        sdm.FAULTS, "gdn-offset-zero", [("json", "NoSuchClass", "build", None)]
    )
    with pytest.raises(RuntimeError, match=r"json\.NoSuchClass\.build not found"):
        sdm.apply_fault("gdn-offset-zero")


def _cam(qlens, num_reqs=None):
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        query_start_loc_cpu=qsl,
        num_reqs=num_reqs or len(qlens),
        max_query_len=max(qlens),
    )


@pytest.mark.parametrize(
    "qlens, plan",
    [
        ([4, 4, 4], ("uniform", 4)),
        ([1, 1], None),
        ([4, 1, 30], ("rows", [(0, 4)])),
        ([2, 4, 9], ("rows", [(0, 2), (2, 6)])),
    ],
)
def test_plan_verify_rows(monkeypatch, qlens, plan):
    monkeypatch.setenv("HYBRIDKV_MATRIX_NUM_SPEC", "3")
    build = sdm._plan_verify_rows(lambda self, cpl, cam: SimpleNamespace())
    md = build(None, 0, _cam(qlens))
    assert getattr(md, "_matrix_fault", None) == plan


def _reference_new_only(q, k, v, scale):
    # float64 reference: causal attention over the row's own tokens, GQA.
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    t = q.shape[0]
    s = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v.double())


@pytest.mark.parametrize("plan_kind", ["uniform", "rows", "metadata"])
def test_verify_new_tokens_only_fault(plan_kind, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_MATRIX_NUM_SPEC", "3")
    torch.manual_seed(0)
    hq, hk, d, t, b = 4, 2, 8, 4, 3
    n = b * t + 5  # 5 prefill tokens after the verify rows in the "rows" case
    impl = SimpleNamespace(num_heads=hq, num_kv_heads=hk, head_size=d, scale=0.3)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)
    marker = 7.0

    def orig(self, layer, query, key, value, kv_cache, md, output=None):
        return output.fill_(marker)

    fwd = sdm._verify_new_tokens_only(orig)
    if plan_kind == "uniform":
        plan, rows = ("uniform", t), [(i * t, (i + 1) * t) for i in range(b)]
        n_used = b * t
        md = SimpleNamespace(_matrix_fault=plan)
    elif plan_kind == "rows":
        rows = [(0, t), (t, 2 * t)]
        plan, n_used = ("rows", rows), 2 * t
        md = SimpleNamespace(_matrix_fault=plan)
    else:
        # No plan from build: verify rows batched as decodes, read off md.
        rows, n_used = [(i * t, (i + 1) * t) for i in range(b)], b * t
        md = SimpleNamespace(max_query_len=t, num_decodes=b, num_decode_tokens=b * t)
    qq, kk, vv = q[:n_used], k[:n_used], v[:n_used]
    out = fwd(
        impl,
        None,
        qq.reshape(n_used, -1),
        kk,
        vv,
        None,
        md,
        torch.empty(n_used, hq * d),
    )
    out = out.view(n_used, hq, d)
    for s, e in rows:
        ref = _reference_new_only(qq[s:e], kk[s:e], vv[s:e], impl.scale)
        torch.testing.assert_close(out[s:e].double(), ref, atol=1e-5, rtol=1e-5)
    # Without a plan the real forward's output is untouched.
    md = SimpleNamespace()
    out = fwd(
        impl,
        None,
        qq.reshape(n_used, -1),
        kk,
        vv,
        None,
        md,
        torch.empty(n_used, hq * d),
    )
    assert bool((out == marker).all())


def test_gdn_offset_zero_fault():
    seen = []

    def orig(self, cpl, cam, num_accepted_tokens=None, num_draft_cpu=None, fast=False):
        seen.append((num_accepted_tokens, num_draft_cpu, fast))
        return "md"

    build = sdm._gdn_offset_zero(orig)
    acc = torch.tensor([4, 1, 3], dtype=torch.int32)
    assert build(None, 0, None, acc, "drafts", fast=True) == "md"
    assert seen[-1][0].tolist() == [1, 1, 1] and seen[-1][1:] == ("drafts", True)
    assert acc.tolist() == [4, 1, 3]  # the runner's tensor is left alone
    build(None, 0, None, num_accepted_tokens=acc)
    assert seen[-1][0].tolist() == [1, 1, 1]
    # Non-speculative steps pass no counts; nothing to do.
    build(None, 0, None)
    assert seen[-1][0] is None


def test_kv_sensitivity():
    records = {
        "qwen3_next.auto.none.NONE": {"outputs": [[1, 2, 3], [4, 5, 6]]},
        "qwen3_next.turboquant_4bit_nc.none.NONE": {"outputs": [[1, 9, 3], [4, 5, 6]]},
        "qwen3_next.turboquant_3bit_nc.none.NONE": {"crash": "x"},
        "qwen3_next.turboquant_4bit_nc.mtp3.NONE": {"outputs": [[0]]},
    }
    expected = (
        "turboquant_4bit_nc vs auto (qwen3_next, NONE): 1/2 prompts equal, "
        "first differences at tokens [1]"
    )
    assert sdm.kv_sensitivity(records) == [expected]


_FAKE_CHILD = """
import json, sys, time
args = json.load(open(sys.argv[2]))
if args["mode"] == "crash":
    raise ValueError("no engine for you\\nsecond line")
if args["mode"] == "hang":
    time.sleep(60)
json.dump({"outputs": [[1]], "seconds": 0.1, "metrics": {}}, open(sys.argv[3], "w"))
"""


@pytest.mark.parametrize(
    "mode, expect",
    [
        ("ok", {"rc": 0, "outputs": [[1]]}),
        ("crash", {"rc": 1, "crash": "ValueError: no engine for you"}),
        ("hang", {"rc": "timeout", "crash": "TIMEOUT after 3s"}),
    ],
)
def test_spawn_records_results_crashes_and_timeouts(
    tmp_path, monkeypatch, mode, expect
):
    (tmp_path / "fake_child.py").write_text(_FAKE_CHILD)
    monkeypatch.setattr(sdm, "MODULE", "fake_child")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    rec = sdm.spawn(mode, {"mode": mode}, tmp_path / "out", 3, env)
    for k, v in expect.items():
        assert rec[k] == v
    assert (tmp_path / "out" / "logs" / f"{mode}.log").exists()


_FAKE_ENGINE = """
import json, sys
args = json.load(open(sys.argv[2]))
eng = args["engine"]
outs = [[(t * 7 + i) % 2048 for i in range(8)] for t in range(len(args["prompts"]))]
if eng.get("speculative_config") and args["fault"] and eng["kv_cache_dtype"] != "auto":
    outs[3][5] += 1
metrics = {}
if eng.get("speculative_config"):
    metrics = {"histogram": [1, 0, 0, 9], "mean_accept_len": 3.7}
res = {"outputs": outs, "seconds": 0.1, "metrics": metrics}
if args["logprobs"]:
    res["gaps"] = [[1.0] * 8 for _ in outs]
json.dump(res, open(sys.argv[3], "w"))
"""


def _use_fake_engines(tmp_path, monkeypatch, source):
    """Engines are subprocesses running ``source``; no checkpoints are built."""
    (tmp_path / "fake_engine.py").write_text(source)
    monkeypatch.setattr(sdm, "MODULE", "fake_engine")
    monkeypatch.setattr(sdm, "build_checkpoints", lambda root, gains: dict(CKPTS))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


@pytest.mark.parametrize("inject", [None, "verify-new-tokens-only"])
def test_quick_driver_end_to_end_with_fake_engines(tmp_path, monkeypatch, inject):
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_ENGINE)
    out = tmp_path / "out"
    argv = [str(out), "--quick", "--jobs", "4"] + (
        ["--inject", inject] if inject else []
    )
    rc = sdm.main(argv)
    data = json.loads((out / "matrix.json").read_text())
    statuses = {
        f"{r['model']}.{r['kv']}.{r['spec']}.{r['cg']}": r["status"]
        for r in data["rows"]
    }
    assert len(statuses) == len(sdm.QUICK_CELLS)
    assert (out / "logs.tar.gz").stat().st_size > 0
    # References are shared: 6 reference engines + 9 speculative ones.
    assert len(data["records"]) == 15
    if inject is None:
        assert rc == 0 and set(statuses.values()) == {"exact"}
    else:
        assert rc == 1
        for key, status in statuses.items():
            expect = "exact" if ".auto." in key else "DIFF 3@5"
            assert status == expect, key


# Speculative TurboQuant engines differ at prompt 3, token 5, where the
# reference's top-1/top-2 gap is a thousandth of the others: a near-tie.
_FAKE_TIE_ENGINE = _FAKE_ENGINE.replace('and args["fault"] and', "and").replace(
    "[[1.0] * 8 for _ in outs]", "[[1.0] * 8 for _ in outs]; res['gaps'][3][5] = 1e-3"
)


def test_a_gate_run_exits_0_when_its_only_differences_are_flagged_near_ties(
    tmp_path, monkeypatch
):
    """The gate passes a cell whose first difference is a flagged near-tie
    (same_or_tie), and the matrix's exit status in --gate mode agrees (the
    gate's record shows it beside the verdict). Outside --gate a run still
    counts only exact cells."""
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_TIE_ENGINE)
    gate = tmp_path / "gate"
    argv = [str(gate), "--gate", "--only", "model=qwen3_next,spec=mtp1", "--jobs", "4"]
    assert sdm.main(argv) == 0
    rows = json.loads((gate / "matrix.json").read_text())["rows"]
    assert {(r["kv"], r["status"]) for r in rows} == {
        ("auto", "exact"),
        ("turboquant_4bit_nc", "DIFF 3@5 tie"),
    }
    assert sdm.main([str(tmp_path / "quick"), "--quick", "--jobs", "4"]) == 1


def test_inject_run_reuses_clean_references(tmp_path, monkeypatch):
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_ENGINE)
    clean = tmp_path / "clean"
    assert sdm.main([str(clean), "--quick", "--jobs", "4"]) == 0
    out = tmp_path / "fault"
    argv = [str(out), "--quick", "--inject", "gdn-offset-zero", "--refs", str(clean)]
    assert sdm.main(argv) == 1
    logs = {p.name for p in (out / "logs").glob("*.log")}
    assert logs and all("gdn-offset-zero" in n for n in logs)
    with pytest.raises(SystemExit, match="other prompts"):
        sdm.main([str(out), "--quick", "--prompts", "6", "--refs", str(clean)])


def test_resume_runs_only_engines_that_did_not_finish(tmp_path, monkeypatch):
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_ENGINE)
    first = tmp_path / "first"
    assert sdm.main([str(first), "--quick", "--jobs", "4"]) == 0
    # One engine "hit the deadline" in the first run.
    data = json.loads((first / "matrix.json").read_text())
    lost = next(n for n in data["records"] if ".auto." not in n and "none" not in n)
    data["records"][lost] = {"rc": "skipped", "crash": "NOT RUN (deadline)"}
    (first / "matrix.json").write_text(json.dumps(data))
    second = tmp_path / "second"
    assert sdm.main([str(second), "--quick", "--resume", str(first)]) == 0
    logs = {p.name.removesuffix(".log") for p in (second / "logs").glob("*.log")}
    assert logs == {lost}


def test_variant_hook_points_exist_in_installed_vllm():
    import importlib

    for name, targets in sdm.VARIANTS.items():
        for module, cls_name, attr, _ in targets:
            cls = getattr(importlib.import_module(module), cls_name)
            assert attr in vars(cls), f"{name}: {cls_name}.{attr}"
    # What the raw-own-K/V variant calls: the backend's continuation prefill.
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    assert "_continuation_prefill" in vars(TurboQuantAttentionImpl)
    assert not set(sdm.VARIANTS) & set(sdm.FAULTS)


def test_verify_raw_own_kv_recomputes_only_verify_rows(monkeypatch):
    """Verify rows (1 < len <= 1+k with cached context) are recomputed by the
    continuation prefill with their request's context length, block-table row
    and raw new K/V; decode rows and first prefills keep the real output."""
    monkeypatch.setenv("HYBRIDKV_MATRIX_NUM_SPEC", "3")
    hq, hk, d = 2, 1, 4
    calls = []

    class Impl:
        num_heads, num_kv_heads, head_size = hq, hk, d

        def _continuation_prefill(self, layer, q, k, v, cache, bt, cached, seq, *_):
            calls.append((q.shape[0], int(bt[0, 0]), cached, seq, float(k[0, 0, 0])))
            return torch.full((q.shape[0], hq, d), 7.0)

    qlens, seqs = [1, 4, 3, 6], [9, 12, 3, 6]  # decode, verify, prefill, prefill
    n = sum(qlens)
    md = SimpleNamespace(
        num_actual_tokens=n,
        seq_lens=torch.tensor(seqs),
        query_start_loc=torch.tensor([0, 1, 5, 8, 14]),
        block_table=torch.arange(4).unsqueeze(1) * 10,
    )
    key = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, hk, d)
    layer = SimpleNamespace(_tq_Pi=None, _tq_centroids=None)

    def real(self, layer, q, k, v, cache, md, output, *a, **kw):
        return output.fill_(1.0)

    fwd = sdm._verify_raw_own_kv(real)
    out = fwd(
        Impl(),
        layer,
        torch.zeros(n, hq * d),
        key,
        key,
        None,
        md,
        torch.zeros(n, hq * d),
    )
    assert calls == [(4, 10, 8, 12, 1.0)]
    assert out[1:5].eq(7).all() and out[:1].eq(1).all() and out[5:].eq(1).all()


def test_vllm_dummy_weights_are_seeded_per_parameter():
    """Why the dummy dense target and its identical-config draft agree: vLLM's
    dummy init seeds each parameter alike, so equal shapes get equal values."""
    from vllm.model_executor.model_loader.weight_utils import (
        initialize_single_dummy_weight,
    )

    a, b = torch.empty(64, 32), torch.empty(64, 32)
    initialize_single_dummy_weight(a)
    torch.manual_seed(123)  # global RNG state does not matter
    initialize_single_dummy_weight(b)
    assert torch.equal(a, b) and a.abs().max() <= 1e-3 and a.std() > 0


def test_full_run_order_and_shared_compile_env(tmp_path):
    cells = sdm.full_cells()
    names = {c.key: c for cell in cells for c in (cell.reference(), cell)}
    assert len(names) == 156
    order = sorted(names, key=lambda k: sdm._order(names[k]))
    # Compiled references first (each compile group's leader is one of
    # them), eager engines last.
    refs = {names[k].spec for k in order[:32]} | {names[k].cg for k in order[:32]}
    assert refs == {"none", "PIECEWISE", "FULL_AND_PIECEWISE"}
    assert {names[k].cg for k in order[-52:]} == {"NONE"}
    leaders = {}
    for k in order:
        leaders.setdefault(sdm.compile_group(names[k]), names[k])
    assert len(leaders) == 4 * len(sdm.KV_DTYPES)  # 4 checkpoints
    assert {(c.spec, c.cg) for c in leaders.values()} == {
        ("none", "FULL_AND_PIECEWISE")
    }
    env = sdm.child_env(tmp_path, tmp_path / "c", 3, shared_compile=True)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    assert "VLLM_USE_AOT_COMPILE" not in sdm.child_env(tmp_path, None, 3) or (
        "VLLM_USE_AOT_COMPILE" in __import__("os").environ
    )
    args = sdm.parse_args([str(tmp_path)])
    assert args.deadline == sdm.FULL_DEADLINE and args.shared_compile
    assert sdm.parse_args([str(tmp_path), "--quick"]).deadline is None


def test_deadline_records_engines_not_run(tmp_path, monkeypatch):
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_ENGINE)
    out = tmp_path / "out"
    argv = [str(out), "--only", "model=qwen3_dense,kv=auto,cg=NONE", "--deadline", "5"]
    assert sdm.main(argv) == 1
    rows = json.loads((out / "matrix.json").read_text())["rows"]
    assert len(rows) == 2
    assert {r["crash"] for r in rows} == {"NOT RUN (deadline)"}


_FAKE_PRECISION_ENGINE = """
import json, sys
args = json.load(open(sys.argv[2]))
eng = args["engine"]
outs = [[(t * 7 + i) % 2048 for i in range(8)] for t in range(len(args["prompts"]))]
metrics = {}
if eng.get("speculative_config"):
    acc = 30 if args["fault"] else 27
    if args["fault"] and eng["model"].endswith("qwen3_next"):
        outs[0][3] += 1
    metrics = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": acc,
               "histogram": [0, 0, 3, 7], "mean_accept_len": 1 + acc / 10}
res = {"outputs": outs, "seconds": 0.1, "metrics": metrics}
if args["logprobs"]:
    res["gaps"] = [[1.0] * 8 for _ in outs]
json.dump(res, open(sys.argv[3], "w"))
"""


def test_verify_precision_driver_with_fake_engines(tmp_path, monkeypatch, capsys):
    _use_fake_engines(tmp_path, monkeypatch, _FAKE_PRECISION_ENGINE)
    out = tmp_path / "out"
    argv = [str(out), "--verify-precision", "--kvs", "turboquant_4bit_nc"]
    assert sdm.main(argv) == 0
    data = json.loads((out / "precision.json").read_text())
    assert len(data["rows"]) == 2 * len(sdm.PRECISION_CELLS)
    # Every engine is eager; the variant only in the raw rows' engines.
    args = [json.loads(p.read_text()) for p in (out / "logs").glob("*.args.json")]
    assert all(a["engine"]["enforce_eager"] for a in args)
    assert {a["fault"] for a in args} == {None, sdm.RAW}
    dummy = [a["engine"] for a in args if "dummy" in a["engine"]["model"]]
    assert dummy and all(e["load_format"] == "dummy" for e in dummy)
    text = capsys.readouterr().out
    lines = {" ".join(ln.split()) for ln in text.splitlines()}
    assert "dummy_dense 4bit_nc draft3 raw own K/V 100.0% 4.00 yes" in lines
    assert "dummy_dense 4bit_nc draft3 quantized 90.0% 3.70 yes" in lines
    assert "qwen3_next 4bit_nc mtp3 raw own K/V 100.0% 4.00 no (DIFF 0@3)" in lines
    assert sdm.main(["--table", str(out / "precision.json")]) == 0
    assert "raw own K/V" in capsys.readouterr().out


def test_unstable_prompts_are_reported_beside_the_strict_count():
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    records = {
        "m.kv.none.NONE": {"outputs": same},
        "m.kv.none.PIECEWISE": {"outputs": other},
        "m.auto.none.NONE": {"outputs": same},
        "m.auto.none.PIECEWISE": {"outputs": same},
        "m.kv.mtp3.NONE": {"outputs": other},
        "m.kv.none.NONE.some-fault": {"outputs": other},
    }
    assert sdm.unstable_prompts(records) == {"m.kv": [1]}
    rows = [
        {"model": "qwen3_next", "kv": "kv", "spec": "mtp3", "cg": "NONE"},
        {"model": "qwen3_next", "kv": "auto", "spec": "mtp3", "cg": "NONE"},
    ]
    for r in rows:
        r.update(status="DIFF 1@1 tie", first_diffs=[(1, 1)], prompts_exact="1/2")
    renamed = {k.replace("m.", "qwen3_next.", 1): v for k, v in records.items()}
    rows = sdm.with_unstable_prompts(rows, renamed)
    assert [r["unstable_prompts"] for r in rows] == [[1], []]
    table = sdm.format_table(rows)
    # The strict count stays; the second line counts only the first row,
    # whose one difference is on a prompt the references disagree on.
    assert "0/2 cells exact" in table
    assert "1/2 cells exact on every prompt whose output without" in table


@pytest.mark.parametrize(
    "only, named",
    [
        # A value no cell has: named with the values there are.
        ("model=nope", "--only model=nope: no cell of this matrix has that model"),
        ("kv=4bit_nc", "its kv values: auto, turboquant_4bit_nc"),
        # Values that exist, but in no cell together.
        ("model=qwen3_5,spec=ngram3", "matches all of these at once"),
    ],
)
def test_only_that_selects_no_cell_says_which_filter(only, named):
    # It printed "no cells selected" and nothing about why.
    with pytest.raises(SystemExit, match=re.escape(named)):
        sdm.select(list(sdm.QUICK_CELLS), only)


def test_only_selects_the_cells_it_names():
    chosen = sdm.select(list(sdm.QUICK_CELLS), "model=qwen3_next,cg=NONE")
    assert [(c.kv, c.spec) for c in chosen] == [
        ("auto", "mtp3"),
        ("turboquant_4bit_nc", "mtp3"),
    ]
