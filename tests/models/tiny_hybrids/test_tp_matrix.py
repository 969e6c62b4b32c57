# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of tp_matrix.py: engines, planner arguments, KV-token
comparison, table, the driver with fake engines, and that every engine's
config (and a draft model's) builds and plans under the CPU platform."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import spec_decode_matrix as sdm
from . import tp_matrix as tpm

pytestmark = pytest.mark.cpu_test

CKPTS = {"qwen3_next": "/c/qwen3_next", "qwen3_5": "/c/qwen3_5"}
MODELS4 = {n: f"/m/{n}" for n in tpm.TP4_SHAPES}


def test_tp2_engines():
    engines = tpm.tp2_engines(CKPTS)
    names = [e.name for e in engines]
    assert len(set(names)) == 8
    # References first, the two models interleaved (compile cache reuse).
    assert [e.spec for e in engines] == ["none"] * 4 + ["mtp3"] * 4
    assert [e.model for e in engines[:2]] == ["qwen3_next", "qwen3_5"]
    for e in engines:
        kw = e.kwargs
        assert kw["tensor_parallel_size"] == 2
        assert "compilation_config" not in kw and "enforce_eager" not in kw
        assert kw["kv_cache_memory_bytes"] == 256 * 2**20
        assert kw["kv_cache_dtype"] == e.kv
        if e.spec == "none":
            assert e.ref is None and "speculative_config" not in kw
        else:
            assert e.ref == f"{e.model}.{e.kv}.none.tp2" and e.ref in names
            assert kw["speculative_config"] == {
                "method": "mtp",
                "num_speculative_tokens": 3,
            }
    assert engines[1].kwargs.get("language_model_only") is True
    json.dumps([e.kwargs for e in engines])


def test_tp4_engines():
    gemma, coder = tpm.tp4_engines(MODELS4)
    assert gemma.kwargs["max_model_len"] == 262144
    assert gemma.kwargs["tensor_parallel_size"] == 4
    assert gemma.kwargs["kv_cache_dtype"] == "turboquant_4bit_nc"
    assert gemma.child["long_prompt_tokens"] > 200_000
    assert coder.kwargs["speculative_config"]["model"] == "/m/LocoOperator-4B"
    assert len(tpm.long_prompt(1000)) == 1000
    assert tpm.long_prompt(50) == tpm.long_prompt(50)


def test_planner_argv():
    engines = {e.name: e for e in tpm.tp2_engines(CKPTS)}
    argv = tpm.planner_argv(engines["qwen3_5.turboquant_4bit_nc.mtp3.tp2"].kwargs)
    assert argv[0] == "/c/qwen3_5" and argv[-1] == "--json"
    text = " ".join(argv)
    for part in (
        "--max-model-len 512",
        "--kv-cache-dtype turboquant_4bit_nc",
        "--tensor-parallel-size 2",
        "--kv-cache-memory-bytes 268435456",
        "--num-speculative-tokens 3",
        "--language-model-only",
    ):
        assert part in text
    plain = tpm.planner_argv(engines["qwen3_next.auto.none.tp2"].kwargs)
    assert "--num-speculative-tokens" not in plain
    assert "--language-model-only" not in plain
    coder = tpm.planner_argv(tpm.tp4_engines(MODELS4)[1].kwargs)
    assert "--draft /m/LocoOperator-4B --num-speculative-tokens 3" in " ".join(coder)
    # The engine's step budget: its sliding-window layers hold window + one step
    # per request (H200: 609,270 KV tokens; planned at serve's 2048, 923,783).
    gemma = tpm.planner_argv(tpm.tp4_engines(MODELS4)[0].kwargs)
    assert "--max-num-batched-tokens 8192" in " ".join(gemma)
    cmd = tpm.planner_command(engines["qwen3_next.auto.none.tp2"].kwargs)
    assert cmd[cmd.index("kv-capacity") + 1 :] == plain


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
        ({"kv_cache_memory_bytes": None}, "no kv_cache_memory_bytes"),
        ({"speculative_config": {"method": "eagle3"}}, "mtp and draft_model"),
    ],
)
def test_planner_argv_refuses_what_it_cannot_plan(kwargs, match):
    base = tpm.tp2_engines(CKPTS)[0].kwargs
    with pytest.raises(ValueError, match=match):
        tpm.planner_argv({**base, **kwargs})


def test_planner_argv_parses_as_kv_capacity():
    kv_capacity = pytest.importorskip("vllm.entrypoints.cli.kv_capacity")
    for e in [*tpm.tp2_engines(CKPTS), *tpm.tp4_engines(MODELS4)]:
        request = kv_capacity.request_from_args(
            kv_capacity.make_parser().parse_args(tpm.planner_argv(e.kwargs))
        )
        kw = e.kwargs
        assert request.model == kw["model"]
        assert request.tensor_parallel_size == kw["tensor_parallel_size"]
        assert request.kv_cache_memory_bytes == kw["kv_cache_memory_bytes"]
        assert request.kv_cache_dtype == kw["kv_cache_dtype"]
        assert request.max_model_len == kw["max_model_len"]
        spec = kw.get("speculative_config") or {}
        assert request.num_speculative_tokens == spec.get("num_speculative_tokens", 0)
        assert request.language_model_only == bool(kw.get("language_model_only"))


def test_engine_kv_tokens_and_status():
    log = (
        "INFO 11-23 [kv_cache_utils.py:1] GPU KV cache size: 1,000 tokens\n"
        "(EngineCore_DP0 pid=7) INFO 11-23 12:00:00 [kv_cache_utils.py:1741] "
        "GPU KV cache size: 60,672 tokens\n"
    )
    assert tpm.engine_kv_tokens(log) == 60672
    assert tpm.engine_kv_tokens("nothing") is None
    assert tpm.kv_status(60672, {"kv_tokens": 60672}) == "equal"
    assert tpm.kv_status(60000, {"kv_tokens": 60672}) == "DIFF -672"
    assert tpm.kv_status(None, {"kv_tokens": 1}) == "no engine value"
    assert tpm.kv_status(1, {"error": "x", "kv_tokens": None}) == "PLAN ERROR"
    assert tpm.kv_status(1, None) == "no plan"


def test_run_planner_reads_json_and_errors(tmp_path, monkeypatch):
    class Proc:
        def __init__(self, stdout, stderr="", returncode=0):
            self.stdout, self.stderr, self.returncode = stdout, stderr, returncode

    monkeypatch.setattr(
        tpm.subprocess, "run", lambda *a, **k: Proc('{"kv_tokens": 7}\n')
    )
    kw = tpm.tp2_engines(CKPTS)[0].kwargs
    report = tpm.run_planner(kw, tmp_path / "p.log")
    assert report["kv_tokens"] == 7 and "kv-capacity" in report["cmd"]
    assert "kv-capacity" in (tmp_path / "p.log").read_text()
    monkeypatch.setattr(
        tpm.subprocess,
        "run",
        lambda *a, **k: Proc("", "ValueError: no config.json", 2),
    )
    assert tpm.run_planner(kw, tmp_path / "p.log")["error"] == (
        "rc=2: ValueError: no config.json"
    )


def _rows():
    engines = {e.name: e for e in tpm.tp2_engines(CKPTS)}
    out = [[1, 2, 3], [4, 5, 6]]
    records = {
        "qwen3_next.auto.none.tp2": {"outputs": out, "wall": 50.0, "kv_tokens": 9},
        "qwen3_next.auto.mtp3.tp2": {
            "outputs": [[1, 2, 3], [4, 9, 6]],
            "wall": 60.0,
            "kv_tokens": 5,
            "metrics": {"histogram": [1, 0, 0, 5], "mean_accept_len": 3.5},
        },
        "qwen3_5.auto.none.tp2": {"crash": "RuntimeError: NCCL", "wall": 9.0},
        "qwen3_5.auto.mtp3.tp2": {"outputs": out, "wall": 30.0, "kv_tokens": 4},
    }
    plans = {
        "qwen3_next.auto.none.tp2": {"kv_tokens": 9},
        "qwen3_next.auto.mtp3.tp2": {"kv_tokens": 5},
        "qwen3_5.auto.none.tp2": {"kv_tokens": 8},
        "qwen3_5.auto.mtp3.tp2": {"kv_tokens": None, "error": "engine refused"},
    }
    return [
        tpm.engine_row(engines[n], records[n], records, plans[n], None) for n in records
    ]


def test_engine_rows_and_table():
    rows = _rows()
    by = {r["engine"]: r for r in rows}
    assert by["qwen3_next.auto.none.tp2"]["status"] == "ran"
    assert tpm.row_ok(by["qwen3_next.auto.none.tp2"])
    spec = by["qwen3_next.auto.mtp3.tp2"]
    assert spec["status"] == "DIFF 1@1" and spec["exact"] == "1/2"
    assert spec["kv_status"] == "equal" and not tpm.row_ok(spec)
    assert by["qwen3_5.auto.none.tp2"]["status"] == "CRASH"
    # The spec engine ran but its reference crashed.
    assert by["qwen3_5.auto.mtp3.tp2"]["status"] == "CRASH(ref)"
    gemma = tpm.gemma_rows(
        {
            "engines": [
                {"case": "tq", "rc": 0, "text_tokens": [1] * 16, "image_tokens": [2]},
                {"case": "auto", "rc": 1, "error": "ValueError: x"},
            ]
        }
    )
    table = tpm.format_table(rows, gemma)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["engine", "status", "exact"]
    assert "qwen3_next.auto.mtp3.tp2  DIFF 1@1" in table
    assert "3.50" in table and "equal" in table and "PLAN ERROR" in table
    assert "qwen3_5.auto.none.tp2: RuntimeError: NCCL" in table
    assert "qwen3_5.auto.mtp3.tp2 planner: engine refused" in table
    assert "1/4 engines ran" in table
    assert "tq         ran    text 16 tokens, image+text 1 tokens" in table
    assert lines[-1] == "1/2 gemma4 engines answered"
    assert tpm.gemma_rows({"error": "TIMEOUT"})[0]["status"] == "CRASH"
    assert tpm.gemma_rows(None) == []


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["o"], {"tp": 2, "jobs": 2, "budget": 450, "gemma": "parallel"}),
        (["o", "--tp", "4"], {"tp": 4, "budget": 540, "jobs": 1}),
        (["o", "--jobs", "1", "--budget", "300"], {"jobs": 1, "budget": 300}),
        (["--table", "x.json"], {"table": "x.json"}),
    ],
)
def test_parse_args(argv, expect):
    args = tpm.parse_args(argv)
    assert {k: getattr(args, k) for k in expect} == expect


def test_parse_args_rejects():
    for argv in ([], ["o", "--tp", "3"], ["o", "--jobs", "0"]):
        with pytest.raises(SystemExit):
            tpm.parse_args(argv)


@pytest.fixture
def fake_world(monkeypatch):
    """Engines, planner and Gemma run as functions; the ckpt build is a stub."""
    from . import checkpoints

    monkeypatch.setattr(checkpoints, "build_all", lambda root, names: dict(CKPTS))
    monkeypatch.setattr(checkpoints, "bigram_prompts", lambda n: [[1, 2, 3]] * n)
    calls = []

    def spawn(name, args, outdir, timeout, env):
        calls.append((name, sdm.MODULE, env["VLLM_ENABLE_V1_MULTIPROCESSING"]))
        assert args["engine"]["tensor_parallel_size"] == 2
        logs = Path(outdir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        tokens = 100 + len(name)
        (logs / f"{name}.log").write_text(f"GPU KV cache size: {tokens:,} tokens\n")
        return {"outputs": [[5, 6, 7]] * len(args["prompts"]), "wall": 1.0}

    monkeypatch.setattr(tpm, "spawn", spawn)
    monkeypatch.setattr(
        tpm, "run_planner", lambda kw, log: {"kv_tokens": 100 + len(log.name) - 12}
    )
    monkeypatch.setattr(
        tpm,
        "run_gemma",
        lambda outdir, tp, timeout, extra: {
            "engines": [
                {"case": c, "rc": 0, "text_tokens": [1], "image_tokens": [2]}
                for c in ("tq", "tq-flag", "auto")
            ]
        },
    )
    return calls


def test_driver_with_fake_engines(tmp_path, fake_world, capsys):
    rc = tpm.main([str(tmp_path), "--prompts", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(fake_world) == 8
    assert {c[2] for c in fake_world} == {"1"}  # engine core in its own process
    assert {c[1] for c in fake_world} == {tpm.MODULE}
    assert sdm.MODULE == "tests.models.tiny_hybrids.spec_decode_matrix"
    table = out[out.index("engine  ") :]
    assert "8/8 engines ran" in table and "3/3 gemma4 engines answered" in table
    data = json.loads((tmp_path / "tp_matrix.json").read_text())
    assert [r["kv_status"] for r in data["rows"]] == ["equal"] * 8
    assert (tmp_path / "logs.tar.gz").exists()
    assert tpm.main(["--table", str(tmp_path / "tp_matrix.json")]) == 0
    assert "8/8 engines ran" in capsys.readouterr().out


def test_driver_skips_engines_past_the_budget(tmp_path, fake_world, capsys):
    rc = tpm.main([str(tmp_path), "--budget", "60", "--min-engine-time", "61",
                   "--gemma", "off", "--only", "qwen3_next"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and not fake_world
    assert out.count("SKIPPED") >= 4 and "gemma4" not in out.split("engine  ")[-1]
    table = out.split("engine  ")[-1]
    assert "CRASH" not in table  # a budget's skips are not crashes


def test_a_difference_at_a_flagged_near_tie_counts_as_equal():
    """As in the release gate: the TP=2 run's qwen3_next 4bit_nc MTP engine
    differed from its reference at one flagged near-tie (11/12 exact)."""
    row = {"status": "DIFF 10@2 tie", "kv_status": "equal"}
    assert tpm.row_ok(row)
    assert not tpm.row_ok({"status": "DIFF 10@2", "kv_status": "equal"})
    assert not tpm.row_ok({"status": "DIFF 10@2 tie", "kv_status": "DIFF -3"})


def test_a_timeout_is_named_as_one():
    eng = tpm.tp2_engines(CKPTS)[0]
    rec = {"crash": "TIMEOUT after 97s", "wall": 97.0}
    row = tpm.engine_row(eng, rec, {}, {"kv_tokens": 5}, None)
    assert row["status"] == "TIMEOUT" and not tpm.row_ok(row)
    rec = {"crash": "RuntimeError: Engine core initialization failed", "wall": 9.0}
    assert tpm.engine_row(eng, rec, {}, None, None)["status"] == "CRASH"


@pytest.mark.parametrize("tp, only", [(2, "qwen3_next.turboquant"), (4, None)])
def test_engine_configs_build_and_plan_on_cpu(tmp_path, capsys, tp, only):
    """Every engine's VllmConfig builds at its TP under the CPU platform and
    the planner plans it (needs the patched vLLM: kv-capacity, TurboQuant on
    hybrids). At TP=4 the Gemma-4-31B budget holds the > 200k-token prompt."""
    pytest.importorskip("vllm.v1.core.kv_cache_capacity")
    argv = [str(tmp_path), "--check-configs", "--tp", str(tp)]
    rc = tpm.main(argv + (["--only", only] if only else []))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2/2 engine configs build and plan" in out
    if tp == 4:
        line = next(ln for ln in out.splitlines() if "gemma_4_31b" in ln)
        tokens = int(line.split("planner: ")[1].split(" KV")[0].replace(",", ""))
        assert tokens >= tpm.GEMMA_31B_MAX_LEN > tpm.LONG_PROMPT_TOKENS


def test_child_dispatch(monkeypatch):
    """TP=2 payloads go to spec_decode_matrix's child function; every engine
    process is this module's (it ends the engine core and workers)."""
    monkeypatch.setattr(sdm, "run_child", lambda args: {"sdm": True})
    assert tpm.run_child({"engine": {}, "prompts": []}) == {"sdm": True}


def test_end_children_kills_descendants():
    import time

    import psutil

    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    for _ in range(100):
        sleepers = psutil.Process(shell.pid).children()
        if len(sleepers) == 2:
            break
        time.sleep(0.05)
    assert len(sleepers) == 2
    tpm.end_children(shell.pid)
    assert shell.wait(timeout=10) is not None
    assert not any(p.is_running() and p.status() != "zombie" for p in sleepers)


class _Out:
    def __init__(self, ids, finished):
        self.outputs = [type("C", (), {"token_ids": ids})()]
        self.finished = finished


class _FakeEngine:
    """add_request / has_unfinished_requests / step, one token per step after a
    first step that only prefills."""

    def __init__(self, tokens):
        self.tokens, self.steps, self.added = tokens, 0, []

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, len(prompt["prompt_token_ids"])))

    def has_unfinished_requests(self):
        return self.steps <= self.tokens

    def step(self):
        self.steps += 1
        ids = list(range(self.steps - 1))
        return [_Out(ids, len(ids) == self.tokens)] if self.steps > 1 else []


def test_timed_request_measures_first_token_and_decode_rate():
    engine = _FakeEngine(tokens=5)
    timing = tpm.timed_request(engine, [1] * 300, params=None)
    assert engine.added == [("timed-0", 300)]
    assert timing["token_ids"] == [0, 1, 2, 3, 4]
    assert 0 <= timing["ttft_s"] <= timing["total_s"]
    assert timing["decode_tok_s"] is None or timing["decode_tok_s"] > 0


def test_draft_config_is_checked_as_the_drafter_builds_it(
    tmp_path, capsys, monkeypatch
):
    """The check builds the draft's VllmConfig with the proposer's own code: a
    dense draft with a shorter context than a hybrid main (which stopped the
    drafter's config on vLLM 0.20.2, the H200 TP=4 run's first Coder boot)
    now builds, and a draft config that does not build fails the check."""
    pytest.importorskip("vllm.v1.core.kv_cache_capacity")
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    engines = tpm.tp4_engines

    def longer(models, tp=4):
        out = engines(models, tp)
        out[1].kwargs["max_model_len"] = 65536  # the draft's own limit is 40960
        return out

    monkeypatch.setattr(tpm, "tp4_engines", longer)
    argv = [str(tmp_path), "--check-configs", "--tp", "4", "--only", "coder"]
    assert tpm.main(argv) == 0, capsys.readouterr().out

    def refused(self):
        raise ValueError("the draft's config does not build")

    monkeypatch.setattr(DraftModelProposer, "_create_draft_vllm_config", refused)
    assert tpm.main(argv) == 1
    assert "the draft's config does not build" in capsys.readouterr().out


def test_gemma4_takes_token_prompts_without_a_tokenizer(tmp_path):
    """vLLM 0.20.2 refuses token-id prompts on a skip_tokenizer_init Gemma 4 (it
    asks the tokenizer for a chat template first): the H200 TP=4 run's first
    long-prompt request. The child gives the renderer the default parameters."""
    pytest.importorskip("vllm.v1.core.kv_cache_capacity")
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    gemma = tpm.tp4_engines(tpm.write_tp4_models(tmp_path))[0]
    config = EngineArgs(**gemma.kwargs).create_engine_config()
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        renderer_from_config(config).default_cmpl_tok_params  # noqa: B018
    renderer = renderer_from_config(config)
    tpm._token_prompts_without_tokenizer(SimpleNamespace(renderer=renderer))
    params = renderer.default_cmpl_tok_params
    assert params.max_total_tokens == tpm.GEMMA_31B_MAX_LEN
    (prompt,) = renderer.render_cmpl(
        [{"prompt_token_ids": tpm.long_prompt(64)}], params
    )
    assert prompt["prompt_token_ids"] == tpm.long_prompt(64)


def test_check_configs_runs_in_a_fresh_process(tmp_path):
    """As a command on a host without a GPU: vLLM binds its platform when its
    modules are imported, so the planning platform must be set first."""
    pytest.importorskip("vllm.v1.core.kv_cache_capacity")
    cmd = [sys.executable, "-m", tpm.MODULE, str(tmp_path), "--check-configs",
           "--tp", "4", "--only", "gemma"]  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("HYBRIDKV_TEST_PLATFORM", None)  # as a user's shell has it
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1/1 engine configs build and plan" in proc.stdout


def test_tp4_row_reports_backends_and_prompt_length():
    gemma = tpm.tp4_engines(MODELS4)[0]
    rec = {
        "outputs": [[1] * 8],
        "wall": 200.0,
        "kv_tokens": 5,
        "prompt_tokens": [tpm.LONG_PROMPT_TOKENS],
        "backends": {
            "0": "TRITON_ATTN/auto",
            "1": "TRITON_ATTN/auto",
            "5": "TURBOQUANT/turboquant_4bit_nc",
        },
    }
    row = tpm.engine_row(gemma, rec, {}, {"kv_tokens": 5}, None)
    assert tpm.row_ok(row)
    table = tpm.format_table([row])
    assert "layers: TRITON_ATTN/auto x2, TURBOQUANT/turboquant_4bit_nc x1" in table
    assert "1 prompts, longest 200,704 tokens, 8 generated" in table
    rec["timing"] = {"ttft_s": 41.2, "decode_tok_s": 20.5, "total_s": 44.3}
    row = tpm.engine_row(gemma, rec, {}, {"kv_tokens": 5}, None)
    table = tpm.format_table([row])
    assert "time to first token 41.2 s, decode 20.5 tok/s, 44.3 s in all" in table
