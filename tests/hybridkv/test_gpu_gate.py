# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the GPU gate (tests/gpu_gate.py): what it reads from each
lane, which row passes, the root cause it names, its exit statuses."""

import json

import pytest

from tests import gpu_gate as gate
from tests.models.tiny_hybrids import ports
from tests.models.tiny_hybrids.spec_decode_matrix import first_root_cause

ASSERT = (
    "/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:193: operator(): block: "
    "[0,0,0], thread: [3,0,0] Assertion `idx >= 0 && idx < self_dim_size && "
    '"index_copy_(): index out of bounds"` failed.'
)
ENGINE_LOG = "\n".join(
    [
        "INFO 11-27 10:00:00 [llm_base_proposer.py:420] proposing",
        ASSERT,
        "Traceback (most recent call last):",
        "RuntimeError: CUDA error: device-side assert triggered",
        "RuntimeError: Engine core initialization failed. See root cause above.",
        "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling "
        "`cublasGemmEx`",
    ]
)


def test_the_root_cause_is_the_first_device_assert_not_the_last_exception():
    cause = first_root_cause(ENGINE_LOG)
    assert "IndexKernel.cu:193" in cause and "index_copy_" in cause
    plain = "ValueError: bad shape\nRuntimeError: Engine core initialization failed\n"
    assert first_root_cause(plain) == "ValueError: bad shape"


def _lane(name, rc=0, log=None):
    return gate.Lane(name, [], 0, log=log, rc=rc, seconds=1.0)


def test_rows_from_each_lane(tmp_path):
    cell = {"model": "m", "kv": "k", "cg": "NONE"}
    matrix = {
        "rows": [
            {**cell, "spec": "draft3", "status": "exact"},
            {**cell, "spec": "mtp3", "status": "DIFF 1@5 tie",
             "first_diffs": [[1, 5]], "prompts_exact": "11/12"},
            {**cell, "spec": "ngram3", "status": "CRASH(spec)",
             "root_cause": "IndexKernel.cu:193 ..."},
        ],
        "records": {"m.k.draft3.NONE": {"wall": 12.5}},
    }  # fmt: skip
    (tmp_path / "matrix.json").write_text(json.dumps(matrix))
    rows = gate.spec_rows(tmp_path / "matrix.json", _lane("spec"))
    assert [r.passed for r in rows] == [True, True, False]
    assert rows[0].seconds == 12.5
    assert "token 5" in rows[1].root_cause and rows[2].root_cause.startswith("Index")

    (tmp_path / "suite.xml").write_text(
        "<testsuites><testsuite>"
        '<testcase classname="tests.kernels.a" name="t1" time="2"/>'
        '<testcase classname="tests.kernels.a" name="t2" time="1">'
        '<failure message="AssertionError: 0.5 &lt; 1e-3">long text</failure>'
        '</testcase><testcase classname="tests.kernels.a" name="t3">'
        '<skipped message="no fp16"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = gate.junit_rows(tmp_path / "suite.xml", _lane("suite", rc=1))
    assert [(r.cell, r.status, r.passed) for r in rows] == [
        ("tests/kernels/a.py::t1", "passed", True),
        ("tests/kernels/a.py::t2", "failed", False),
        ("tests/kernels/a.py::t3", "skipped", True),
    ]
    assert rows[1].root_cause == "AssertionError: 0.5 < 1e-3"

    tqm = [
        {"name": "a.none", "ok": True, "seconds": 3.0},
        {"name": "a.mtp", "ok": True, "tie": "differs at near-ties [(4, 11)]"},
        {"name": "b.mtp", "ok": False, "against": "x no-spec",
         "why": "first difference (prompt, token) (0, 9)"},
    ]  # fmt: skip
    (tmp_path / "tqm.json").write_text(json.dumps(tqm))
    rows = gate.tqm_rows(tmp_path / "tqm.json", _lane("tqm", rc=1))
    assert [(r.status, r.passed) for r in rows] == [
        ("ok", True), ("ok tie", True), ("FAILED", False)
    ]  # fmt: skip
    assert "(4, 11)" in rows[1].root_cause and "(0, 9)" in rows[2].root_cause


def test_a_lane_stopped_at_the_deadline_is_a_failed_row(tmp_path):
    log = tmp_path / "spec.log"
    log.write_text("  [10/48] 480s\n")
    (row,) = gate.spec_rows(tmp_path / "missing.json", _lane("spec", "killed", log))
    assert not row.passed and row.status == "NOT FINISHED"
    assert row.root_cause == "[10/48] 480s"
    table = gate.format_table([row])
    assert "NOT FINISHED" in table[1] and "[10/48]" in table[1]


def test_a_run_cut_by_its_deadline_says_so_and_what_to_run(tmp_path):
    """Release 54's gate on a slower host: cells the deadline did not reach
    (and a lane stopped at it) are failures, and the record names them as
    cut, with the two-call gate to run instead; a run without cut cells has
    no such line."""
    facts = dict(vllm="0.20.2+hybridkv.54", date="d", device="NVIDIA H200",
                 torch="2.11.0", triton="3.6.0", transformers="5.17.0")  # fmt: skip
    cut = [
        gate.Row("spec", "m.turboquant_4bit_nc.mtp1.NONE", "CRASH(ref+spec)", 0,
                 "NOT RUN (deadline)"),
        gate.Row("spec", "m.turboquant_4bit_nc.mtp1.FULL", "CRASH(spec)", 26,
                 "TIMEOUT after 26s"),
        gate.Row("suite", "suite (whole lane)", "NOT FINISHED", 432, ""),
    ]  # fmt: skip
    ok = [gate.Row("tqm", "a.none", "ok", 3.0)]
    lanes = [_lane("spec", 1), _lane("suite", "killed")]
    md = gate.summary_md(ok + cut, facts, lanes, 478, False)
    assert "— FAIL" in md
    (line,) = [ln for ln in md.splitlines() if ln.startswith("- out of time")]
    assert "left 2 cell(s)" in line
    assert "spec m.turboquant_4bit_nc.mtp1.NONE, suite suite (whole lane)" in line
    assert "`--lanes spec` and then `--lanes kernels,tqm,suite,serve`" in line
    assert "out of time" not in gate.summary_md(ok + cut[1:2], facts, lanes, 9, False)


@pytest.mark.parametrize(
    ("gpus", "chosen", "where"),
    [
        (2, gate.LANES, dict(spec=0, kernels=1, tqm=1, suite=1, serve=1)),
        (2, ("spec",), dict(spec=0)),
        # The second call of a two-call gate: the four lanes take both GPUs.
        (2, ("kernels", "tqm", "suite", "serve"),
         dict(kernels=0, tqm=1, suite=0, serve=1)),
        (1, gate.LANES, dict(spec=0, kernels=0, tqm=0, suite=0, serve=0)),
    ],
)  # fmt: skip
def test_the_lanes_of_a_call_and_their_gpus(tmp_path, gpus, chosen, where):
    lanes = gate.lanes_for(tmp_path, gpus, 8, 500, chosen=chosen)
    assert {lane.name: lane.gpu for lane in lanes} == where


def test_no_gpu_and_bad_arguments_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gate, "gpu_count", lambda: 0)
    assert gate.main([str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        gate.main([str(tmp_path), "--deadline", "10"])
    assert bad.value.code == 2


@pytest.mark.parametrize("xdist", [True, False])
def test_the_kernels_lane_spreads_over_xdist_workers_where_installed(
    tmp_path, monkeypatch, xdist
):
    real = gate.importlib.util.find_spec
    monkeypatch.setattr(
        gate.importlib.util,
        "find_spec",
        lambda name: (object() if xdist else None) if name == "xdist" else real(name),
    )
    (kernels,) = [
        lane for lane in gate.lanes_for(tmp_path, 2, 8, 560) if lane.name == "kernels"
    ]
    spread = ["-n", str(gate.KERNEL_JOBS), "--dist", "loadfile"]
    assert (kernels.cmd[6:10] == spread) is xdist
    assert kernels.cmd[-1] == "tests/kernels" and kernels.gpu == 1


def test_a_partial_run_never_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gate, "gpu_count", lambda: 1)

    def serve_ok(lanes, outdir, deadline, t0):
        (outdir / "serve").mkdir()
        (outdir / "serve" / "serve.json").write_text(
            json.dumps([{"lane": "serve", "cell": "server boots", "status": "ok"}])
        )
        for lane in lanes:
            lane.rc, lane.seconds = 0, 1.0

    monkeypatch.setattr(gate, "run_lanes", serve_ok)
    assert gate.main([str(tmp_path), "--lanes", "serve"]) == 1
    md = (tmp_path / "gate.md").read_text()
    assert "PARTIAL RUN, no verdict" in md and "--lanes serve" in md
    with pytest.raises(SystemExit) as bad:
        gate.main([str(tmp_path), "--lanes", "serve,bogus"])
    assert bad.value.code == 2
    assert "unknown ['bogus']" in capsys.readouterr().err


def _serve_lane_with_work(lanes, outdir, deadline, t0):
    """The serve lane as it leaves its folder: results, a server log and the
    checkpoint it built; beside it a lane log of the gate's own."""
    serve = outdir / "serve"
    (serve / "ckpt" / "qwen3_next").mkdir(parents=True)
    (serve / "serve.json").write_text(
        json.dumps([{"lane": "serve", "cell": "server boots", "status": "ok"}])
    )
    (serve / "server.log").write_text("INFO started\n")
    (serve / "ckpt" / "qwen3_next" / "config.json").write_text("{}")
    (serve / "ckpt" / "qwen3_next" / "model.safetensors").write_bytes(b"\0" * 4096)
    (outdir / "serve.log").write_text("lane output\n")
    for lane in lanes:
        lane.rc, lane.seconds = 0, 1.0


@pytest.mark.parametrize("keep", [False, True])
def test_a_run_leaves_its_record_and_one_archive_of_logs(tmp_path, monkeypatch, keep):
    """A device call brings back at most 8 files of under 16 MiB: the run's
    folder keeps gate.md, gate.json and logs.tar.gz (the lanes' logs and
    results, no checkpoint) and nothing else, unless --keep-work."""
    import tarfile

    monkeypatch.setattr(gate, "gpu_count", lambda: 1)
    monkeypatch.setattr(gate, "run_lanes", _serve_lane_with_work)
    out = tmp_path / "gate"
    argv = [str(out), "--lanes", "serve"] + (["--keep-work"] if keep else [])
    assert gate.main(argv) == 1  # a partial run
    kept = {"gate.md", "gate.json", "logs.tar.gz"}
    assert {p.name for p in out.iterdir()} == kept | (
        {"serve", "serve.log"} if keep else set()
    )
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == ["serve.log", "serve/serve.json", "serve/server.log"]
    assert json.loads((out / "gate.json").read_text())["rows"][0]["status"] == "ok"


def test_the_table_counts_passing_test_cases_and_lists_each_failure():
    rows = [
        gate.Row("spec", "m.k.draft3.NONE", "exact", 30.0),
        *(gate.Row("kernels", f"t{i}", "passed", 1.0) for i in range(3)),
        gate.Row("kernels", "t3", "skipped", 0.0),
        gate.Row("kernels", "t4", "failed", 2.0, "AssertionError: 0.5 < 1e-3"),
    ]
    shown = gate.shown_rows(rows)
    assert [(r.lane, r.cell, r.status) for r in shown] == [
        ("spec", "m.k.draft3.NONE", "exact"),
        ("kernels", "3 passed, 1 skipped", "passed"),
        ("kernels", "t4", "failed"),
    ]
    assert "AssertionError: 0.5 < 1e-3" in gate.format_table(shown)[-1]


def test_the_suite_runs_each_test_in_its_own_process(tmp_path, monkeypatch):
    tests = tmp_path / "suite_tests"
    tests.mkdir()
    (tests / "test_three.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\ndef test_passes():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_fails():\n    raise ValueError('wrong')\n\n"
        "@pytest.mark.gpu\ndef test_stopped():\n    pass\n\n"
        "def test_not_gpu():\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gate, "SUITE_PATHS", ("suite_tests",))
    out = tmp_path / "suite"
    assert gate.main([str(out), "--suite-run", "--jobs", "2"]) == 1
    nodes = json.loads((out / "nodes.json").read_text())
    assert [n.rsplit("::", 1)[1] for n in nodes] == [
        "test_passes", "test_fails", "test_stopped"
    ]  # fmt: skip
    # The third test's report is gone, as when the deadline stops its process.
    (out / "002.xml").unlink()
    rows = gate.suite_rows(out, _lane("suite", rc=1))
    assert [r.status for r in rows] == ["passed", "failed", "NOT FINISHED"]
    assert "wrong" in rows[1].root_cause
    assert rows[2].cell == nodes[2]


def test_suite_tests_that_run_at_once_get_disjoint_port_ranges(tmp_path, monkeypatch):
    """Each suite test is a pytest process whose first engine takes the first
    port of its range; four running at once (each waits for the others)
    must be handed four ranges that do not meet (the release-64 gate lost a
    suite test to ``EADDRINUSE`` on its lane's first ports)."""
    tests = tmp_path / "suite_tests"
    tests.mkdir()
    (tests / "test_ports.py").write_text(
        "import os, pathlib, time\n"
        "import pytest\n\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_port(i):\n"
        "    out = pathlib.Path(__file__).parent.parent / 'ports'\n"
        "    out.mkdir(exist_ok=True)\n"
        f"    env = [os.environ.get(k, '') for k in ({ports.PORT_BASE_ENV!r}, "
        f"{ports.PORT_CHILDREN_ENV!r})]\n"
        "    (out / str(i)).write_text(' '.join(env))\n"
        "    deadline = time.time() + 60\n"
        "    while len(list(out.iterdir())) < 4 and time.time() < deadline:\n"
        "        time.sleep(0.05)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gate, "SUITE_PATHS", ("suite_tests",))
    monkeypatch.setenv(ports.PORT_BASE_ENV, ports.lane_base(2))
    monkeypatch.delenv(ports.PORT_CHILDREN_ENV, raising=False)
    assert gate.main([str(tmp_path / "suite"), "--suite-run", "--jobs", "4"]) == 0
    ranges = []
    for f in (tmp_path / "ports").iterdir():
        base, children = (f.read_text().split() + [""])[:2]
        children = int(children or ports.CHILDREN_PER_BASE)
        ranges.append((int(base), int(base) + ports.PORTS_PER_CHILD * children))
    ranges.sort()
    assert len(ranges) == 4
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    lane = int(ports.lane_base(2))
    assert lane <= ranges[0][0] and ranges[-1][1] <= lane + ports.PORTS_PER_BASE


def _part(tmp_path, name, lanes, status="passed", **facts):
    """A gate run's record of some lanes, as main() writes it."""
    part = tmp_path / name
    part.mkdir()
    facts = {"date": "2026-11-28 23:00 UTC", "device": "NVIDIA H200",
             "vllm": "0.20.2+hybridkv.34", "torch": "2.11.0", "triton": "3.6.0",
             "transformers": "5.17.0",
             "command": f"bash scripts/gpu-gate.sh --lanes {','.join(lanes)}",
             **facts}  # fmt: skip
    rows = [{"lane": ln, "cell": f"{ln} cell", "status": status, "seconds": 1.0,
             "root_cause": ""} for ln in lanes]  # fmt: skip
    lanes = [{"name": ln, "gpu": 0, "rc": 0, "seconds": 100.0} for ln in lanes]
    record = {"facts": facts, "wall": 100.0, "rows": rows, "lanes": lanes}
    (part / "gate.json").write_text(json.dumps(record))
    return part


OTHER_LANES = ["kernels", "tqm", "suite", "serve"]


def test_two_calls_of_one_gpu_combine_into_one_record(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "gpu_count", lambda: 0)  # combining needs no GPU
    spec = _part(tmp_path, "a", ["spec"])
    other = _part(tmp_path, "b", OTHER_LANES)
    out = tmp_path / "gate"
    assert gate.main([str(out), "--combine", str(spec), str(other)]) == 0
    md = (out / "gate.md").read_text()
    assert "0.20.2+hybridkv.34 — PASS" in md
    assert "--lanes spec` then `bash scripts/gpu-gate.sh --lanes kernels" in md
    assert "wall: 200 s" in md
    record = json.loads((out / "gate.json").read_text())
    assert [ln["name"] for ln in record["lanes"]] == ["spec", *OTHER_LANES]


def test_a_combined_record_needs_every_lane_and_every_cell(tmp_path):
    spec = _part(tmp_path, "a", ["spec"])
    assert gate.main([str(tmp_path / "g1"), "--combine", str(spec)]) == 1
    assert "PARTIAL RUN" in (tmp_path / "g1" / "gate.md").read_text()
    failed = _part(tmp_path, "b", OTHER_LANES, status="failed")
    assert gate.main([str(tmp_path / "g2"), "--combine", str(spec), str(failed)]) == 1
    assert "— FAIL" in (tmp_path / "g2" / "gate.md").read_text()


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (dict(lanes=["spec", "tqm"]), "lane spec ran in both"),
        (dict(lanes=OTHER_LANES, vllm="0.20.2+hybridkv.33"), "different vllm"),
        (dict(lanes=OTHER_LANES, device="NVIDIA H100 80GB HBM3"), "different GPUs"),
    ],
)
def test_parts_that_do_not_combine_exit_2(tmp_path, capsys, second, message):
    spec = _part(tmp_path, "a", ["spec"])
    lanes = second.pop("lanes")
    other = _part(tmp_path, "b", lanes, **second)
    out = tmp_path / "gate"
    assert gate.main([str(out), "--combine", str(spec), str(other)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
    assert gate.main([str(out), "--combine", str(tmp_path / "none")]) == 2
    assert "not a gate run's record" in capsys.readouterr().err
