# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The e2e harness's --lanes: the table spread over several GPUs of one host,
one harness process per GPU, every ratio taken against the auto of its own
GPU, the lanes' rows merged into one result."""

import json
import sys

import pytest

from tests.benchmarks import import_benchmark, readme_command


@pytest.fixture(scope="module")
def e2e():
    return import_benchmark("benchmarks.e2e.benchmark_turboquant_e2e")


# One lane's harness without vLLM: it waits until every lane has started (so
# the lanes provably run at once), then writes that lane's result file. auto
# runs at 100 tok/s times (GPU + 1) and every other KV dtype 1.1x its own
# GPU's auto: a ratio taken across GPUs reads anything but 1.10.
_FAKE_LANE = """
import json, os, pathlib, sys, time
lane, out, started, lanes, behaviour = sys.argv[1:6]
lane = json.loads(lane)
gpu = int(os.environ["CUDA_VISIBLE_DEVICES"])
pathlib.Path(started, str(gpu)).write_text(os.environ["VLLM_CACHE_ROOT"])
deadline = time.monotonic() + 30
while len(os.listdir(started)) < int(lanes) and time.monotonic() < deadline:
    time.sleep(0.02)
if len(os.listdir(started)) < int(lanes):
    sys.exit("the lanes did not run at once")
if behaviour == "fail":
    sys.exit(3)
base = 100.0 * (gpu + 1)
rows = []
for kv in lane["kv"]:
    tok = base if kv == "auto" else 1.1 * base
    scen = {n: dict(repeats=1, output_tok_s=tok, output_tok_s_spread=None,
                    ttft_median_s=0.1, ttft_p90_s=0.1, prefill_median_s=0.1,
                    tpot_median_s=0.01, tpot_p90_s=0.01)
            for n in lane["scenarios"]}
    rows.append(dict(model=lane["model"], kv=kv, rc=0, wall_s=1.0,
                     kv_tokens=1000, device="fake H100", scenarios=scen))
pathlib.Path(out, "e2e-1.json").write_text(json.dumps(dict(meta={}, rows=rows)))
"""


def _fake_lanes(e2e, monkeypatch, tmp_path, n, behaviour=None):
    started = tmp_path / "started"
    started.mkdir(parents=True)
    asked = []

    def lane_command(lane, args, out):
        asked.append((lane, args.repeats))
        how = (behaviour or {}).get(len(asked) - 1, "ok")
        return [sys.executable, "-c", _FAKE_LANE, json.dumps(lane), str(out),
                str(started), str(n), how]  # fmt: skip

    monkeypatch.setattr(e2e, "lane_command", lane_command)
    return asked, started


def _lanes_command():
    return readme_command(r"`python (benchmarks/e2e/\S+ [^`]*--lanes[^`]*)`")


@pytest.mark.parametrize("visible", [None, "7,6,5,4"])
def test_lanes_run_at_once_and_take_each_ratio_on_their_own_gpu(
    e2e, monkeypatch, capsys, tmp_path, visible
):
    """benchmarks/README.md's --lanes command, as written: four lanes, GPUs
    0-3 (counted within CUDA_VISIBLE_DEVICES where it is set), each with its
    own auto and torch.compile cache; the merged rows carry their GPU and
    every ratio is 1.10x (its own GPU's auto)."""
    command = _lanes_command()
    specs = command.split("--lanes ")[1].split(" --")[0].split()
    asked, started = _fake_lanes(e2e, monkeypatch, tmp_path / "s", len(specs))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    physical = visible.split(",") if visible else [str(g) for g in range(4)]
    monkeypatch.setattr(sys, "argv", [*command.split(), "--out", str(tmp_path)])
    e2e.main()

    assert [lane["model"] for lane, _ in asked] == [s.split(":")[0] for s in specs]
    assert all(lane["kv"][0] == "auto" for lane, _ in asked)
    assert {repeats for _, repeats in asked} == {1}
    # Every (model, scenario) of the full table, each in one lane.
    covered = [(lane["model"], n) for lane, _ in asked for n in lane["scenarios"]]
    assert sorted(covered) == sorted((m, n) for m in e2e.MODELS for n in e2e.SCENARIOS)
    assert {p.name: p.read_text() for p in started.iterdir()} == {
        physical[g]: str(tmp_path / "cache" / f"gpu{g}") for g in range(len(specs))
    }
    (json_file,) = tmp_path.glob("e2e-*.json")
    result = json.loads(json_file.read_text())
    rows = result["rows"]
    assert [lane["rc"] for lane in result["meta"]["lanes"]] == [0] * len(specs)
    assert {r["gpu"] for r in rows} == set(range(len(specs)))
    ratios = [
        s["output_tok_s_vs_auto"]
        for r in rows
        if r["kv"] != "auto"
        for s in r["scenarios"].values()
    ]
    assert len(ratios) == 2 * 1 + 2 * 4 + 3 * 6 + 5 * 11  # non-auto x scenarios
    assert ratios == pytest.approx([1.1] * len(ratios))
    md = capsys.readouterr().out
    assert "ratios are to the `auto` on the same GPU" in md
    assert "| Qwen3-4B (GPU 3) | turboquant_3bit_nc | 1,000 (1.00x) | mixed | " in md


def test_a_failed_lane_is_named_and_the_others_are_kept(
    e2e, monkeypatch, capsys, tmp_path
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_lanes(e2e, monkeypatch, tmp_path / "s", 2, behaviour={1: "fail"})
    monkeypatch.setattr(sys, "argv", ["benchmark_turboquant_e2e.py", "--lanes",
        "Qwen3-4B:short-decode:turboquant_k8v4", "Qwen3.6-27B:mixed",
        "--gpus", "2", "5", "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        e2e.main()
    assert "lane(s) on GPU [5] failed" in str(exit_.value.code)
    (json_file,) = tmp_path.glob("e2e-*.json")
    result = json.loads(json_file.read_text())
    assert [(lane["gpu"], lane["rc"]) for lane in result["meta"]["lanes"]] == [
        (2, 0),
        (5, 3),
    ]
    assert [(r["gpu"], r["kv"]) for r in result["rows"]] == [
        (2, "auto"),
        (2, "turboquant_k8v4"),
    ]
