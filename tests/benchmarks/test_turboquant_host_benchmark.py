# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host-time benchmark (benchmarks/kernels/benchmark_turboquant_host.py)
without a GPU: the steps it builds, its table, and its refusal to time on a
machine without CUDA."""

import os
import subprocess
import sys

import pytest
import torch

from tests.benchmarks import REPO, import_benchmark


@pytest.fixture
def bench():
    return import_benchmark("benchmarks.kernels.benchmark_turboquant_host")


def test_a_mixed_step_puts_decode_rows_first_on_pages_of_their_own(bench):
    cam, num_pages = bench._step_metadata(3, 40, 2, 20, torch.device("cpu"))
    assert cam.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 23, 43]
    assert cam.seq_lens.tolist() == [40, 40, 40, 20, 20]
    assert (cam.max_query_len, cam.max_seq_len) == (20, 40)
    table = cam.block_table_tensor
    used = [
        table[r, : -(-s // bench.PAGE)].tolist()
        for r, s in enumerate([40] * 3 + [20] * 2)
    ]
    pages = [p for row in used for p in row]
    assert 0 not in pages and len(set(pages)) == len(pages) == num_pages - 1
    # A decode row writes its last position; a first chunk every position.
    slots = cam.slot_mapping.tolist()
    assert slots[0] == used[0][39 // bench.PAGE] * bench.PAGE + 39 % bench.PAGE
    chunk = [used[3][p // bench.PAGE] * bench.PAGE + p % bench.PAGE for p in range(20)]
    assert slots[3:23] == chunk


def test_the_table_shows_host_time_beyond_the_gpu_per_layer(bench):
    rows = [
        dict(kv="auto", step="decode", update=(19.0, 5.0), forward=(59.0, 428.0)),
        dict(
            kv="turboquant_k8v4",
            step="decode",
            build=(3.0, 0.0),
            update=(62.0, 6.0),
            forward=(145.0, 206.0),
        ),
    ]
    md = bench.markdown("H100", rows)
    assert "| auto | decode | - | 19 / 5 | 59 / 428 | -355 |" in md
    assert "| turboquant_k8v4 | decode | 3 | 62 / 6 | 145 / 206 | -5 |" in md


def test_without_cuda_it_says_so_and_times_nothing(
    bench, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_documented_command_runs_from_the_repo_root_and_needs_a_gpu(tmp_path):
    # benchmarks/README.md's command, as written, on a machine without a GPU.
    out = subprocess.run(
        [sys.executable, "benchmarks/kernels/benchmark_turboquant_host.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path)),
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "needs a CUDA GPU" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_preset_is_named_before_anything_runs(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--presets", "turboquant_5bit"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'turboquant_5bit'" in err
    assert "turboquant_k8v4" in err  # the valid ones


def test_the_first_token_step_is_the_e2e_scenarios_prefill_alone(bench):
    """The e2e harness's first-token scenario is one step of first chunks;
    the host benchmark times that step's layer, and its table names it
    without decode rows."""
    e2e = import_benchmark("benchmarks.e2e.benchmark_turboquant_e2e")
    prompts, prompt_len, _ = e2e.SCENARIOS["first-token"]
    step = bench.STEPS["first-token"]
    assert (step["decodes"], step["prefills"], step["prefill_len"]) == (
        0,
        prompts,
        prompt_len,
    )
    cam, _ = bench._step_metadata(**step, device=torch.device("cpu"))
    assert cam.num_actual_tokens == prompts * prompt_len
    assert cam.max_query_len == cam.max_seq_len == prompt_len
    md = bench.markdown("H100", [])
    assert "first-token = 32 first chunks x 64" in md
    assert "decode = 512 decode rows x 576;" in md


def test_an_ab_of_host_time_interleaves_its_rounds(bench, monkeypatch):
    """Two versions' host times come from one process, rounds alternating
    in order, so a drift of the host between rounds reaches both."""
    calls = []
    times = iter([10.0, 20.0, 21.0, 11.0, 12.0, 22.0, 23.0, 13.0])

    def fake_round(fn, n):
        fn()
        return next(times), 0.0

    monkeypatch.setattr(bench, "_round", fake_round)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    got = bench.paired_host_us(
        lambda: calls.append("a"), lambda: calls.append("b"), rounds=4
    )
    # One warm-up call each, then AB, BA, AB, BA.
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert got == dict(a=11.5, a_min=10.0, b=21.5, b_min=20.0, b_minus_a=10.0)


def test_the_table_shows_what_the_builders_halves_save(bench):
    halves = dict(a=256.0, a_min=212.0, b=285.0, b_min=243.0, b_minus_a=53.3)
    rows = [
        dict(
            kv="turboquant_k8v4",
            step="mixed",
            build=(86.0, 1.7),
            update=(59.0, 63.0),
            forward=(251.0, 267.0),
            halves=dict(halves, cut=38.1),
        )
    ]
    md = bench.markdown("H200", rows)
    assert "| turboquant_k8v4 | 285 (243) | 256 (212) | 53 | 38.1 |" in md


def test_the_table_shows_what_launch_keys_save(bench):
    keys = {
        "turboquant_4bit_nc": dict(
            forward=dict(a=190.0, a_min=181.0, b=165.0, b_min=158.0, b_minus_a=-24.6),
            update=dict(a=52.0, a_min=50.0, b=47.0, b_min=45.0, b_minus_a=-5.2),
        )
    }
    md = bench.markdown("H200", [], keys=keys)
    assert "| turboquant_4bit_nc | forward | 190 (181) | 165 (158) | 24.6 |" in md
    assert "| turboquant_4bit_nc | update | 52 (50) | 47 (45) | 5.2 |" in md


def test_the_launch_key_ab_restores_the_keys(bench, monkeypatch):
    """Whatever the rounds do, launches are keyed again afterwards."""
    from vllm.triton_utils.compiled_launch import CompiledLaunch

    keyed = CompiledLaunch.__dict__["_args_key"]
    seen = []

    def fake_pair(fa, fb):
        fa()
        seen.append(CompiledLaunch.__dict__["_args_key"])
        fb()
        seen.append(CompiledLaunch.__dict__["_args_key"])
        raise RuntimeError("round failed")

    monkeypatch.setattr(bench, "paired_host_us", fake_pair)
    monkeypatch.setattr(bench, "_tq_builder", lambda *a: _Builder())
    with pytest.raises(RuntimeError, match="round failed"):
        bench.launch_keys_saving("turboquant_k8v4", torch.device("cpu"))
    assert seen[0] is not keyed and seen[1] is keyed
    with pytest.raises(TypeError):
        seen[0].__func__((1,))
    assert CompiledLaunch.__dict__["_args_key"] is keyed


class _Builder:
    def build(self, *args):
        return None


_ROTATIONS = [
    ("vllm.v1.attention.ops.turboquant_decode", "rotate_query"),
    ("vllm.v1.attention.ops.turboquant_decode", "rotate_query_with_offset"),
]


@pytest.mark.parametrize(
    "preset, rotation",
    [
        ("turboquant_k8v4", None),
        ("turboquant_4bit_nc", "rotate_query_with_offset"),
        ("turboquant_3bit_nc", "rotate_query_with_offset"),
    ],
)
def test_a_decode_step_takes_the_key_offset_an_engines_layer_takes(
    bench, preset, rotation
):
    """The layer the host benchmark times carries the key offset an engine's
    layer of that preset carries (patch 0027's ``bind_key_offsets``), so its
    decode rotates the query with ``q . mu`` as served. The CPU forward with
    every launch skipped, each rotation's calls recorded."""
    forward, _ = bench.decode_step_calls(preset, torch.device("cpu"))
    with bench.launches_skipped():
        seen = bench.recorded_returns(forward, _ROTATIONS)
    called = [name for (_, name), values in seen.items() if values]
    assert called == ([rotation] if rotation else [])


def test_every_launch_skipped_includes_launches_by_mapping(bench):
    """The Gluon stage 1 launches through ``launch_with``: a forward with
    every launch skipped must skip those too, or its Python would carry one
    launch."""
    from vllm.triton_utils.compiled_launch import CompiledLaunch

    unlaunchable = CompiledLaunch(object())  # launching it raises TypeError
    with bench.launches_skipped():
        assert unlaunchable.launch_with((1,), (), {}) is None
        assert unlaunchable.launch((1,)) is None


def test_every_function_the_breakdown_replaces_is_where_its_caller_reads_it(bench):
    """Each of DECODE_CALLEES is a module global its callers read at the
    call: a renamed or moved function fails here, not as a silent `-` row."""
    import importlib

    for module_name, name in bench.DECODE_CALLEES:
        module = importlib.import_module(module_name)
        assert callable(module.__dict__.get(name)), f"{module_name}.{name}"


def test_the_breakdown_replays_one_function_at_a_time(bench, monkeypatch):
    """Each target in turn returns what it returned in the recording, in
    order, without running; the others run; every module is as it was
    afterwards, also when a round fails."""
    import sys
    import types

    fake = types.ModuleType("fake_decode_path")
    ran = []

    def inner(x):
        ran.append("inner")
        return x * 10

    def outer():
        ran.append("outer")
        return [fake.inner(1), fake.inner(2)]

    fake.inner, fake.outer, fake.unused = inner, outer, lambda: None
    monkeypatch.setitem(sys.modules, "fake_decode_path", fake)
    targets = [("fake_decode_path", n) for n in ("outer", "inner", "unused")]
    results = []

    def call():
        results.append(fake.outer())

    def pair(fa, fb):
        ran.clear()
        fa()
        a = list(ran)
        ran.clear()
        fb()
        return dict(b_minus_a=len(ran) - len(a), a_ran=a, b_ran=list(ran))

    costs = bench.function_costs(call, targets, pair=pair)
    assert costs["fake_decode_path.unused"] is None
    assert costs["fake_decode_path.outer"]["b_ran"] == []
    assert costs["fake_decode_path.inner"]["b_ran"] == ["outer"]
    assert costs["fake_decode_path.inner"]["a_ran"] == ["outer", "inner", "inner"]
    # The replayed inner gave back 10 and 20 in turn, as the real one did.
    assert all(r == [10, 20] for r in results)
    assert (fake.inner, fake.outer) == (inner, outer)

    def failing(fa, fb):
        fb()
        raise RuntimeError("round failed")

    with pytest.raises(RuntimeError, match="round failed"):
        bench.function_costs(call, targets, pair=failing)
    assert (fake.inner, fake.outer) == (inner, outer)


def test_the_table_shows_what_each_function_costs_the_forward(bench):
    by_function = {
        "turboquant_4bit_nc": dict(
            forward_launches_skipped=101.5,
            saved={
                "turboquant_decode.decode_attention": 61.2,
                "gluon_turboquant_decode.stage1": None,
            },  # fmt: skip
        )
    }
    md = bench.markdown("H200", [], by_function=by_function)
    assert "| function | turboquant_4bit_nc |" in md
    assert "| the forward | 101.5 |" in md
    assert "| `turboquant_decode.decode_attention` | 61.2 |" in md
    assert "| `gluon_turboquant_decode.stage1` | - |" in md


def test_the_options_ab_copies_what_the_stage1_launch_passes(bench, monkeypatch):
    """The A side of ``launch_options_saving`` launches the kernel, grid,
    arguments and keywords the Gluon stage 1 launches, only copied into
    keyword arguments: the A/B times the copy, not another launch."""
    gluon = pytest.importorskip("vllm.v1.attention.ops.gluon_turboquant_decode")
    calls = []

    class Recorder:
        def launch(self, grid, *args, variant=None, **kwargs):
            calls.append((grid, args, kwargs))

        def launch_with(self, grid, args, options, variant=None):
            calls.append((grid, args, dict(options)))

    monkeypatch.setattr(
        "vllm.triton_utils.compiled_launch.launcher", lambda kernel: Recorder()
    )
    monkeypatch.setattr(gluon, "launcher", lambda kernel: Recorder())
    constexprs = gluon._constexprs(
        head_dim=128, group=4, page=16, key_fp8=False, mse_bits=4,
        key_packed_size=66, norm_correction=True, word32=False, split=True,
        min_split_tokens=256, value_bits=4, tails=False, stride_cp=67, pdl=True,
    )  # fmt: skip
    gluon._launch(gluon._stage1, (8, 3, 2), ("q",), constexprs)
    bench.launch_copying_options()(gluon._stage1, (8, 3, 2), ("q",), constexprs)
    assert calls[0] == calls[1]


def test_the_table_shows_the_options_ab(bench):
    ab = dict(a=120.0, a_min=110.0, b=112.0, b_min=104.0, b_minus_a=-7.5)
    md = bench.markdown("H200", [], options={"turboquant_4bit_nc": {"forward": ab}})
    assert "| turboquant_4bit_nc | forward | 120 (110) | 112 (104) | 7.5 |" in md


def test_the_table_shows_the_plan_ab(bench):
    ab = dict(a=221.0, a_min=203.0, b=107.0, b_min=99.0, b_minus_a=-115.3)
    md = bench.markdown("H200", [], plans={"turboquant_4bit_nc": {"forward": ab}})
    assert "| turboquant_4bit_nc | forward | 221 (203) | 107 (99) | 115.3 |" in md


def test_the_plan_ab_plans_on_one_side_only_and_restores_the_map(bench, monkeypatch):
    """Side A sends no plan and keeps none; side B keeps its plans from one
    call to the next; the module's map and bound are as they were after."""
    from vllm.v1.attention.ops import turboquant_decode

    seen = []

    def forward():
        seen.append((turboquant_decode.MAX_PLANS, id(turboquant_decode._plans)))

    monkeypatch.setattr(bench, "decode_step_calls", lambda p, d: (forward, None))
    monkeypatch.setattr(
        bench, "paired_host_us", lambda fa, fb: [f() for f in (fa, fb, fa, fb)]
    )
    before = (turboquant_decode.MAX_PLANS, id(turboquant_decode._plans))
    bench.plan_saving("turboquant_4bit_nc", torch.device("cpu"))
    a1, b1, a2, b2 = seen
    assert a1[0] == a2[0] == 0
    assert b1[0] == b2[0] == before[0] > 0
    assert b1[1] == b2[1] != before[1]  # one map kept across B's calls
    assert (turboquant_decode.MAX_PLANS, id(turboquant_decode._plans)) == before


def test_every_launch_skipped_includes_launches_of_a_plan(bench):
    """A decode plan calls each compiled kernel's ``run``: with every launch
    skipped that is a stand-in, and the kernels' own afterwards."""
    from triton.compiler import CompiledKernel

    compiled = CompiledKernel.__new__(CompiledKernel)
    compiled._run = lambda *args: pytest.fail("launched")
    with bench.launches_skipped():
        assert compiled.run(1, 2, 3) is None
    assert compiled.run is compiled._run
