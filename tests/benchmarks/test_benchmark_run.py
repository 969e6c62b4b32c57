# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernel benchmarks' command and record (benchmarks/kernels/
benchmark_run.py) without a GPU: a run written whole, and a sweep that fails
part-way."""

import json
import sys

from tests.benchmarks import import_kernel_helper


def _run():
    return import_kernel_helper("benchmark_run")


def test_a_run_is_recorded_whole_as_json_and_markdown(tmp_path, capsys, monkeypatch):
    bench = _run()
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    meta = bench.run_meta(3.0e12, quick=True)
    assert meta["device"] == "NVIDIA H200" and meta["quick"] is True
    assert meta["copy_bandwidth_gbs"] == 3000.0 and meta["vllm"]
    meta["wall_s"] = 1.5
    bench.write_run(
        str(tmp_path / "runs"), "readback", meta, [{"kv": "k8v4"}], "| t |\n"
    )
    written = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert [n.rsplit(".", 1)[1] for n in written] == ["json", "md"]  # no parts left
    (js,) = (tmp_path / "runs").glob("readback-*.json")
    assert json.loads(js.read_text()) == {"meta": meta, "rows": [{"kv": "k8v4"}]}
    assert js.with_suffix(".md").read_text() == "| t |\n"
    assert (
        f"wrote {tmp_path / 'runs'}/{js.stem}.json and .md in 1.5 s"
        in capsys.readouterr().out
    )


def test_a_sweep_keeps_the_rows_measured_before_it_failed(tmp_path, monkeypatch):
    """The store and read-back benchmarks' command: the --quick sizes reach
    the sweep, and a sweep that dies part-way still writes what it measured,
    with the reason."""
    bench = _run()
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(bench, "Timer", lambda iters, warmup: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda timer: 4.0e12)
    monkeypatch.setattr(sys, "argv", ["x", "--quick", "--out", str(tmp_path)])
    seen = []

    def sweep(shapes, sizes, presets, timer, bw, rows, log):
        seen.append((shapes, sizes, presets, bw))
        rows.append({"kv": "k8v4"})
        raise RuntimeError("out of memory")

    bench.sweep_main(
        "Doc.", "quick", "readback", sweep, lambda meta, rows: f"{len(rows)} rows\n",
        full=(["A", "B"], [1, 2]), quick=(["A"], [2]),
    )  # fmt: skip
    assert seen == [(["A"], [2], bench.PRESETS, 4.0e12)]
    (js,) = tmp_path.glob("readback-*.json")
    run = json.loads(js.read_text())
    assert run["rows"] == [{"kv": "k8v4"}]
    assert run["meta"]["aborted"] == "RuntimeError: out of memory"
    assert js.with_suffix(".md").read_text() == "1 rows\n"
