# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The e2e harness's per-step profile (kernel classes and per-step sums), the
engine logs it keeps, how it hands a scenario's requests to the engine, and
how it sums up repeats."""

import json
import os
import re
import signal
import sys
import time
from argparse import Namespace

import pytest

from tests.benchmarks import import_benchmark, readme_command


@pytest.fixture(scope="module")
def e2e():
    return import_benchmark("benchmarks.e2e.benchmark_turboquant_e2e")


@pytest.mark.parametrize(
    "name, label",
    [
        ("_tq_decode_split_stage1", "attention"),
        ("_stage1", "attention"),  # the Gluon decode stage 1
        ("_tq_full_dequant_kv", "attention"),
        ("_tq_decode_split_merge", "attention"),
        ("_fwd_kernel_stage2", "attention"),
        ("_tq_rotate_query", "attention"),
        (
            "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>",
            "attention",
        ),
        ("_tq_store_mse_hadamard", "kv_store"),
        ("_tq_fused_store_fp8", "kv_store"),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", "kv_store"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "gemm"),
        ("void vllm::rms_norm_kernel<c10::BFloat16>", "other"),
        ("triton_poi_fused_mul_silu_0", "other"),
    ],
)
def test_kernel_classes(e2e, name, label):
    assert e2e.kernel_class(name) == label


def test_step_profile_divides_by_steps_and_leaves_the_gap(e2e):
    kernels = [
        ("_tq_decode_split_stage1", 300.0),
        ("_tq_decode_split_merge", 20.0),
        ("sm90_xmma_gemm_bf16", 500.0),
        ("_tq_store_mse_hadamard", 40.0),
        ("rms_norm_kernel", 60.0),
    ]
    prof = e2e.step_profile(kernels, steps=4, wall_s=0.001)
    assert prof["attention"] == pytest.approx(80.0)
    assert prof["gemm"] == pytest.approx(125.0)
    assert prof["kv_store"] == pytest.approx(10.0)
    assert prof["other"] == pytest.approx(15.0)
    assert prof["gpu"] == pytest.approx(230.0)
    assert prof["wall"] == pytest.approx(250.0)
    assert prof["gap"] == pytest.approx(20.0)


def test_step_profile_refuses_zero_steps(e2e):
    with pytest.raises(ValueError, match="at least one output step, got 0"):
        e2e.step_profile([("x", 1.0)], steps=0, wall_s=1.0)


def test_profile_table_shows_the_change_against_auto(e2e):
    def row(kv, attention_us):
        prof = e2e.step_profile([("_tq_decode_split_stage1", attention_us)], 1, 1e-3)
        prof["top"] = [["_tq_decode_split_stage1", attention_us]]
        return dict(model="Qwen3-4B", kv=kv, profile={"short-decode": prof})

    md = e2e.profile_markdown(
        {"device": "H100"}, [row("auto", 100.0), row("turboquant_4bit_nc", 250.0)]
    )
    assert (
        "| Qwen3-4B | auto | short-decode | 100 | 0 | 0 | 0 | 100 | 900 | 1,000 |" in md
    )
    assert "| Qwen3-4B | turboquant_4bit_nc | short-decode | 250 (+150) |" in md


@pytest.mark.parametrize("keep", [True, False])
def test_engine_logs_are_kept_on_request(e2e, monkeypatch, tmp_path, keep):
    # The child engine process, faked: its log and one result line.
    def child(cmd, timeout, env):
        return "INFO GPU KV cache size: 1,000 tokens\n" + e2e._RESULT + "{}\n", 0

    monkeypatch.setattr(e2e, "run_process_group", child)
    args = Namespace(
        repeats=1, gpu_memory_utilization=0.9, timeout=10, out=str(tmp_path),
        keep_logs=keep, max_num_seqs=None,
    )  # fmt: skip
    row = e2e.run_config("Qwen3-4B", "turboquant_k8v4", ["short-decode"], args)
    assert row["kv_tokens"] == 1000
    logs = list(tmp_path.glob("*.log"))
    if keep:
        assert [p.name for p in logs] == ["e2e-Qwen3-4B-turboquant_k8v4.log"]
        assert "GPU KV cache size" in logs[0].read_text()
    else:
        assert logs == []


class _SteppingEngine:
    """``LLM``'s queueing calls over an engine core that steps as soon as it
    holds a request, unless its scheduling is paused (a level-0 sleep)."""

    def __init__(self, fail_enqueue=False):
        self.paused = False
        self.queued = []
        self.first_step = None  # requests the first step held
        self.fail_enqueue = fail_enqueue

    def _step(self):
        if not self.paused and self.queued and self.first_step is None:
            self.first_step = len(self.queued)

    def sleep(self, level, mode):
        assert (level, mode) == (0, "keep"), "must pause scheduling only"
        self.paused = True

    def wake_up(self, tags):
        assert tags == ["scheduling"]
        self.paused = False
        self._step()

    def enqueue(self, prompts, params, use_tqdm):
        for prompt in prompts:
            if self.fail_enqueue:
                raise ValueError("bad prompt")
            self.queued.append(prompt)
            self._step()

    def wait_for_completion(self, use_tqdm):
        self._step()
        return list(self.queued)


def test_the_first_step_holds_every_request(e2e):
    engine = _SteppingEngine()
    outs = e2e.generate_from_full_queue(engine, ["a", "b", "c", "d"], None)
    assert outs == ["a", "b", "c", "d"]
    assert engine.first_step == 4


def test_a_failed_hand_off_leaves_the_engine_scheduling(e2e):
    engine = _SteppingEngine(fail_enqueue=True)
    with pytest.raises(ValueError, match="bad prompt"):
        e2e.generate_from_full_queue(engine, ["a"], None)
    assert not engine.paused


def test_summary_keeps_each_repeats_ttft_and_the_spreads(e2e):
    """TTFT moved by up to 1.5x between runs of the same code: each repeat's
    median TTFT is kept, and its spread printed beside tok/s's."""
    reps = [
        dict(
            wall_s=1.0,
            output_tokens=1,
            output_tok_s=tok,
            ttft_median_s=ttft,
            ttft_p90_s=ttft,
            tpot_median_s=0.005,
            tpot_p90_s=0.005,
        )
        for tok, ttft in [(5600.0, 0.040), (5500.0, 0.060), (5700.0, 0.042)]
    ]
    s = e2e.summarize(reps)
    assert s["ttft_median_s_reps"] == [0.040, 0.060, 0.042]
    assert s["ttft_median_s"] == 0.042
    assert s["ttft_median_s_spread"] == pytest.approx(0.020 / 0.042)
    assert s["output_tok_s_spread"] == pytest.approx(200 / 5600)
    assert e2e.summarize(reps[:1])["ttft_median_s_spread"] is None
    meta = dict(time="t", device="H100", vllm="0.20.2", torch="2.11.0", repeats=3)
    row = dict(model="Qwen3-4B", kv="auto", kv_tokens=1000)
    md = e2e.markdown(meta, [dict(row, scenarios={"decode-heavy": s})])
    assert "| 3.6% / 48% | 42 / 42 (n/ax) |" in md


def test_first_token_times_decode_heavys_prefill_step_alone(
    e2e, monkeypatch, capsys, tmp_path
):
    """benchmarks/README.md's TTFT command: decode-heavy's prompts with one
    output token each, so a repeat is one prefill step (~40 ms) and dozens of
    them fit where decode-heavy's 1,024 decode steps allow a few. Its table
    row has a TTFT and no TPOT."""
    assert e2e.SCENARIOS["first-token"] == e2e.SCENARIOS["decode-heavy"][:2] + (1,)
    specs = []

    def run_config(model, kv, scenarios, args, profile=False):
        specs.append((model, kv, scenarios, args.repeats))
        rep = dict(
            wall_s=0.05,
            output_tokens=32,
            output_tok_s=640.0,
            ttft_median_s=0.035 if kv == "auto" else 0.033,
            ttft_p90_s=0.040,
            prefill_median_s=0.030 if kv == "auto" else 0.027,
            tpot_median_s=None,  # one token: no inter-token time
            tpot_p90_s=None,
        )
        summary = e2e.summarize([rep] * args.repeats)
        return dict(model=model, kv=kv, rc=0, wall_s=1.0, kv_tokens=1000,
                    scenarios={"first-token": summary})  # fmt: skip

    monkeypatch.setattr(e2e, "run_config", run_config)
    command = readme_command(
        r"`python (benchmarks/e2e/\S+ [^`]*first-token --repeats \d+)`"
    )
    monkeypatch.setattr(sys, "argv", [*command.split(), "--out", str(tmp_path)])
    e2e.main()
    assert [kv for _, kv, _, _ in specs] == [
        "auto",
        "turboquant_k8v4",
        "turboquant_4bit_nc",
    ]
    assert {(s[0], tuple(s[2]), s[3]) for s in specs} == {
        ("Qwen3-4B", ("first-token",), 40)
    }
    md = capsys.readouterr().out
    assert "| Qwen3-4B | turboquant_4bit_nc | 1,000 (1.00x) | first-token |" in md
    assert "| 33 / 40 (0.94x) | 27.0 (0.90x) | n/a / n/a (n/ax) |" in md


def test_prefill_is_timed_on_the_engine_cores_clock_apart_from_ttft(e2e):
    """TTFT holds the queue and the hand-off to the engine core; prefill is
    vLLM's prefill_time (first scheduled to first token), the steps alone.
    A request with one token has no TPOT; one without stats counts nowhere."""

    def out(tokens, ttft, scheduled, first, last):
        metrics = Namespace(
            first_token_latency=ttft,
            scheduled_ts=scheduled,
            first_token_ts=first,
            last_token_ts=last,
        )
        return Namespace(outputs=[Namespace(token_ids=[7] * tokens)], metrics=metrics)

    outs = [
        out(5, 0.045, 100.010, 100.044, 100.064),  # slow hand-off: 10 ms queued
        out(1, 0.036, 100.001, 100.034, 100.034),
        Namespace(outputs=[Namespace(token_ids=[7])], metrics=None),
    ]
    ttft, prefill, tpot = e2e.request_times(outs)
    assert ttft == [0.045, 0.036]
    assert prefill == pytest.approx([0.034, 0.033])
    assert tpot == pytest.approx([0.005])


def test_the_queue_is_timed_from_the_engine_cores_queue_to_the_first_step(e2e):
    """TTFT = hand-off + queue + prefill: the queue (queued to first
    scheduled, the engine core's clock) is what earlier requests' steps
    cost a request. A request without its queue stamp counts nowhere."""

    def out(queued, scheduled):
        metrics = Namespace(queued_ts=queued, scheduled_ts=scheduled)
        return Namespace(outputs=[Namespace(token_ids=[7])], metrics=metrics)

    outs = [out(100.0, 100.002), out(100.0, 100.180), out(0.0, 100.1)]
    outs.append(Namespace(outputs=[Namespace(token_ids=[7])], metrics=None))
    assert e2e.queue_times(outs) == pytest.approx([0.002, 0.180])
    rep = dict(output_tok_s=1.0, ttft_median_s=0.2, ttft_p90_s=0.3)
    s = e2e.summarize([dict(rep, queue_median_s=q) for q in (0.09, 0.18, 0.17)])
    assert s["queue_median_s_reps"] == [0.09, 0.18, 0.17]
    assert s["queue_median_s"] == 0.17


def test_each_repeat_keeps_the_gpus_clock_and_the_summary_lists_them(e2e, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 41)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 312_500)  # mW
    state = e2e.gpu_state()
    assert state == dict(sm_mhz=1980, temp_c=41, power_w=312.5)

    def no_nvml(device):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    assert e2e.gpu_state() == dict(
        gpu_state_error="ModuleNotFoundError: nvidia-ml-py does not seem to be "
        "installed"
    )
    rep = dict(output_tok_s=1.0, ttft_median_s=0.04, ttft_p90_s=0.05)
    s = e2e.summarize([dict(rep, prefill_median_s=0.03, gpu=state), rep])
    assert s["prefill_median_s_reps"] == [0.03, None]
    assert s["gpu_reps"] == [state, None]


def test_host_profile_names_where_the_host_time_went(e2e):
    """The profiled engine's gap (wall minus kernels) is host work: its cProfile
    lists the functions by own time, then by cumulative time."""

    def busy():
        return sum(i * i for i in range(20000))

    def run():
        return [busy() for _ in range(3)]

    text = e2e.host_profile(run, lines=10)
    assert text.count("Ordered by: internal time") == 1
    assert text.count("Ordered by: cumulative time") == 1
    assert "(busy)" in text


def test_the_host_profile_pass_runs_only_on_request(e2e, monkeypatch):
    """profile_scenario runs the extra cProfile pass only with host prompts:
    its prompts are fresh (the other passes' would hit the prefix cache)."""
    calls = []

    class _Llm:
        def generate(self, prompts, params, use_tqdm):
            calls.append(prompts)

    import contextlib

    import torch.profiler

    @contextlib.contextmanager
    def no_kernels(activities):
        yield type("Prof", (), {"events": lambda self: []})()

    monkeypatch.setattr(torch.profiler, "profile", no_kernels)
    monkeypatch.setattr(e2e, "step_profile", lambda kernels, steps, wall: {})
    params = type("P", (), {"max_tokens": 4})()
    monkeypatch.setattr(e2e, "host_profile", lambda run: run() or "profiled")
    e2e.profile_scenario(_Llm(), ["untimed"], ["profiled"], params)
    assert calls == [["untimed"], ["profiled"]]
    calls.clear()
    e2e.profile_scenario(_Llm(), ["untimed"], ["profiled"], params, ["host"])
    assert calls == [["untimed"], ["profiled"], ["host"]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timed_out_configuration_takes_its_engine_core_down(e2e, tmp_path):
    """The engine core is the configuration process's own child. Left running
    after a timeout it holds its GPU memory, and the next configuration's
    engine fails to start (a Qwen3.6-27B run lost its second configuration
    that way)."""
    pid_file = tmp_path / "engine_core.pid"
    child = (
        "import subprocess, sys, time\n"
        "sleep = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        "core = subprocess.Popen(sleep)\n"
        f"open({str(pid_file)!r}, 'w').write(str(core.pid))\n"
        "time.sleep(60)\n"
    )
    log, rc = e2e.run_process_group([sys.executable, "-c", child], 5, dict(os.environ))
    assert rc == "timeout"
    core = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(core)
    if alive:
        os.kill(core, signal.SIGKILL)
    assert not alive, "the timed-out configuration's engine core is still running"


@pytest.mark.parametrize(
    "args, named",
    [
        (["--repeats", "0"], "--repeats 0: expected at least 1"),
        (["--timeout", "-5"], "--timeout -5: expected at least 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0: expected at least 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5"),
        # Not the whole matrix (hours) in place of the list left empty.
        (["--kv"], "--kv: expected at least one argument"),
        (["--models"], "--models: expected at least one argument"),
        (["--scenarios"], "--scenarios: expected at least one argument"),
        # --lanes (tests/benchmarks/test_turboquant_e2e_lanes.py)
        (
            ["--lanes", "Qwen3-4B:short-decode", "Qwen3-4B:mixed,short-decode"],
            "Qwen3-4B short-decode is lane 0's already",
        ),
        (["--lanes", "Qwen3-8B"], "unknown model 'Qwen3-8B'"),
        (["--lanes", "Qwen3-4B:short-decod"], "unknown scenario ['short-decod']"),
        (["--lanes", "Qwen3-4B::bf16"], "unknown KV dtype ['bf16']"),
        (["--lanes", "Qwen3-4B:mixed:auto:x"], "found 4 ':'-separated fields"),
        (["--lanes", "Qwen3-4B", "Qwen3.6-27B", "--gpus", "1", "1"], "one distinct"),
        (["--lanes", "Qwen3-4B", "--gpus", "0", "1"], "one distinct GPU per lane"),
        (["--lanes", "Qwen3-4B", "--quick"], "--lanes with --quick"),
        (["--lanes", "Qwen3-4B", "--scenarios", "mixed"], "--lanes with --scenarios"),
        (["--gpus", "1"], "--gpus places --lanes lanes on GPUs"),
        (
            ["--lanes", "Qwen3-4B", "Qwen3.6-27B", "--gpus", "0", "2"],
            "--gpus [0, 2]: expected indices of the GPUs this process sees "
            "(CUDA_VISIBLE_DEVICES=4,5)",
        ),
    ],
)
def test_bad_arguments_are_named_before_any_engine_starts(
    e2e, monkeypatch, capsys, args, named
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")

    def run_config(*a, **k):
        raise AssertionError(f"{args} started a configuration")

    monkeypatch.setattr(e2e, "run_config", run_config)
    monkeypatch.setattr(e2e, "run_lanes", run_config)
    monkeypatch.setattr(sys, "argv", ["benchmark_turboquant_e2e.py", *args])
    with pytest.raises(SystemExit) as exit_:
        e2e.main()
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


# A served engine for --interleave without vLLM: it speaks serve_child's
# protocol, and its TTFT follows a drift shared by every engine (the first
# half of all repeats, counted across processes, run 2x slow) times its own
# factor. The drift moves whole rounds: each round of len(kvs) repeats runs
# in one phase.
_FAKE_ENGINE = """
import json, os, sys
spec = json.loads(sys.argv[1])
counter, rounds, n_kv, behaviour = sys.argv[2:6]
if behaviour == "fail-start":
    print("engine failed to start: CUDA out of memory", flush=True)
    sys.exit(3)
if behaviour == "hang-start":
    import time
    time.sleep(60)
print("INFO GPU KV cache size: 1,234 tokens", flush=True)
reply = lambda **m: print("HYBRIDKV_E2E_REPLY " + json.dumps(m), flush=True)
reply(ready=True)
factor = 1.0 if spec["kv"] == "auto" else 1.05
for line in sys.stdin:
    if not line.strip():
        break
    with open(counter, "a+") as f:
        f.seek(0)
        done = len(f.read())
        f.write(spec["kv"][-1])
    slow = 2.0 if done // int(n_kv) < int(rounds) // 2 else 1.0
    ttft = 0.035 * slow * factor
    rep = dict(wall_s=ttft, output_tokens=32, output_tok_s=32 / ttft,
               ttft_median_s=ttft, ttft_p90_s=ttft, prefill_median_s=ttft,
               tpot_median_s=None, tpot_p90_s=None, gpu={})
    reply(scenario=json.loads(line)["scenario"], repeat=rep, order=done)
reply(done=True, device="fake H100")
"""


def _fake_served(e2e, monkeypatch, tmp_path, rounds, behaviour=None):
    counter = tmp_path / "asked"
    asked = []

    def served_command(spec):
        asked.append(spec)
        how = (behaviour or {}).get(spec["kv"], "serve")
        return [sys.executable, "-c", _FAKE_ENGINE, json.dumps(spec), str(counter),
                str(rounds), "3", how]  # fmt: skip

    monkeypatch.setattr(e2e, "served_command", served_command)
    return asked, counter


def _interleave_command():
    return readme_command(
        r"`python (benchmarks/e2e/\S+ [^`]*first-token[^`]*--interleave[^`]*)`"
    )


def test_interleaved_repeats_pair_each_kv_dtype_with_auto(
    e2e, monkeypatch, capsys, tmp_path
):
    """benchmarks/README.md's --interleave command: three engines resident at
    once, each with a third of the memory, each repeat run on all three in a
    rotating order. A drift that doubles every engine's TTFT for half the run
    cancels in the per-repeat ratio: 1.05x exactly, quartiles included."""
    command = _interleave_command()
    repeats = int(re.search(r"--repeats (\d+)", command)[1])
    asked, counter = _fake_served(e2e, monkeypatch, tmp_path, repeats)
    monkeypatch.setattr(sys, "argv", [*command.split(), "--out", str(tmp_path)])
    e2e.main()
    assert [s["kv"] for s in asked] == [
        "auto",
        "turboquant_k8v4",
        "turboquant_4bit_nc",
    ]
    assert [s["gpu_memory_utilization"] for s in asked] == pytest.approx([0.3] * 3)
    assert {tuple(s["scenarios"]) for s in asked} == {("first-token",)}
    # Each round of three repeats starts one engine later than the last.
    order = counter.read_text()
    assert order[:9] == "o4c4coco4"  # each KV dtype's last letter
    assert len(order) == 3 * repeats
    md = capsys.readouterr().out
    assert "## Interleaved repeats: each repeat over auto's same repeat" in md
    row = f"| Qwen3-4B | turboquant_4bit_nc | first-token | {repeats} |"
    assert f"{row} 0.95x (0.95-0.95) | 1.05x (1.05-1.05) | 1.05x (1.05-1.05) |" in md
    assert "| Qwen3-4B | turboquant_k8v4 | 1,234 (1.00x) | first-token |" in md
    (json_file,) = tmp_path.glob("e2e-*.json")
    rows = json.loads(json_file.read_text())["rows"]
    assert {r["device"] for r in rows} == {"fake H100"}
    assert all(r["rc"] == 0 and r["interleaved"] for r in rows)


def test_max_num_seqs_reaches_every_engine_and_the_table(
    e2e, monkeypatch, capsys, tmp_path
):
    """benchmarks/README.md's high-load command with --max-num-seqs: every
    engine runs that many sequences, and the table says so."""
    command = readme_command(
        r"`python (benchmarks/e2e/\S+ [^`]*high-load[^`]*--max-num-seqs[^`]*)`"
    )
    repeats = int(re.search(r"--repeats (\d+)", command)[1])
    asked, _ = _fake_served(e2e, monkeypatch, tmp_path, repeats)
    monkeypatch.setattr(sys, "argv", [*command.split(), "--out", str(tmp_path)])
    e2e.main()
    assert [s["max_num_seqs"] for s in asked] == [500, 500]
    assert "Engines ran at most 500 sequences at once" in capsys.readouterr().out
    (json_file,) = tmp_path.glob("e2e-*.json")
    assert json.loads(json_file.read_text())["meta"]["max_num_seqs"] == 500


@pytest.mark.parametrize(
    "submitted, runs",
    [(1, 16), (32, 32), (60, 64), (250, 256), (257, 272), (500, 512), (4096, 512)],
)
def test_the_default_sequences_sit_on_vllms_capture_grid(e2e, submitted, runs):
    """Without --max-num-seqs an engine runs what its scenarios submit, at
    least 16 and at most 512, rounded up to a size vLLM captures a graph for
    (steps of 8 below 256, 16 from there): a full decode step replays one."""
    assert e2e.default_max_num_seqs(submitted) == runs


@pytest.mark.parametrize("asked, runs", [(None, 512), (500, 500)])
def test_an_engine_runs_the_sequences_asked_or_its_scenarios_most(
    e2e, monkeypatch, asked, runs
):
    import vllm

    made = {}

    class LLM:
        def __init__(self, **kwargs):
            made.update(kwargs)
            raise RuntimeError("constructed")

    monkeypatch.setattr(vllm, "LLM", LLM)
    spec = dict(model="Qwen3-4B", kv="auto", scenarios=["high-load"],
                gpu_memory_utilization=0.5, max_num_seqs=asked)  # fmt: skip
    with pytest.raises(RuntimeError, match="constructed"), e2e.engine(spec):
        pass
    assert made["max_num_seqs"] == runs


@pytest.mark.parametrize(
    "behaviour, rc, named",
    [
        ("fail-start", 3, "exited with rc 3\nengine failed to start"),
        ("hang-start", "timeout", "timeout"),
    ],
)
def test_an_interleaved_engine_that_does_not_start_fails_alone(
    e2e, monkeypatch, tmp_path, behaviour, rc, named
):
    """A configuration whose engine dies or hangs before it is ready gets a
    FAILED row naming why; the others are still timed against auto."""
    _fake_served(
        e2e, monkeypatch, tmp_path, 4, behaviour={"turboquant_k8v4": behaviour}
    )
    args = Namespace(
        repeats=4,
        gpu_memory_utilization=0.9,
        timeout=3,
        keep_logs=True,
        out=str(tmp_path),
        max_num_seqs=None,
    )
    kvs = ["auto", "turboquant_k8v4", "turboquant_4bit_nc"]
    rows = e2e.run_interleaved("Qwen3-4B", kvs, ["first-token"], args)
    failed, ok = rows[1], [rows[0], rows[2]]
    assert failed["rc"] == rc and "scenarios" not in failed
    assert failed["error_tail"].startswith(named)
    assert all(r["scenarios"]["first-token"]["repeats"] == 4 for r in ok)
    assert (tmp_path / "e2e-Qwen3-4B-turboquant_k8v4-interleaved.log").exists()
    e2e.add_ratios(rows)
    paired = rows[2]["scenarios"]["first-token"]["ttft_median_s_paired"]
    assert paired["median"] == pytest.approx(1.05)


def test_interleave_refuses_the_profile_flags(e2e, monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "argv", ["benchmark_turboquant_e2e.py", "--interleave", "--profile"]
    )
    with pytest.raises(SystemExit) as exit_:
        e2e.main()
    assert exit_.value.code == 2
    assert "--interleave times repeats and does not profile" in (
        capsys.readouterr().err
    )
