# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Running a list's engines: the distinct runs, several at a time, their GPUs and
logs, failures reported per job; and the report over what they wrote."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from hybridkv_lm_eval import config as job_config
from hybridkv_lm_eval import report, sides

from .conftest import HARNESS

pytestmark = pytest.mark.cpu_test

# Stands in for `python -m hybridkv_lm_eval.run_side`: records when it ran and on
# which devices, then writes the scores the job's metadata asks for (or fails).
FAKE_SIDE = r"""
import json, os, sys, time
from pathlib import Path
config, role = sys.argv[1], sys.argv[2]
out, stamps = Path(sys.argv[3]), Path(sys.argv[4])
start = time.time()
time.sleep(float(os.environ.get("FAKE_SIDE_SECONDS", "0.3")))
print(f"fake {role} of {config}")
stamps.mkdir(parents=True, exist_ok=True)
devices = os.environ.get("CUDA_VISIBLE_DEVICES")
stamp = {"start": start, "end": time.time(), "devices": devices}
(stamps / out.stem).write_text(json.dumps(stamp))
scores = json.loads(os.environ["FAKE_SIDE_SCORES"])
key = f"{Path(config).stem}:{role}"
if scores.get(key) == "crash":
    sys.exit(3)
results = scores.get(key) or scores[role]
if results == "abort-after-scores":
    results = scores[role]
run = {"role": role, "model_args": {}, "results": results, "seconds": 0.3}
out.write_text(json.dumps(run))
if scores.get(key) == "abort-after-scores":
    os.abort()
"""


def write_job(path: Path, kv: str, model: str = "org/model") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "model_name": model,
                "tasks": [
                    {
                        "name": "hybridkv_niah_4k",
                        "metrics": [{"name": "niah_recall,none"}],
                    },
                    {
                        "name": "hybridkv_corpus_ppl",
                        "metrics": [
                            {"name": "word_perplexity,none", "rtol": 0.02, "atol": 0.0}
                        ],
                    },
                ],
                "kv_cache_dtype": kv,
                "baseline": {"kv_cache_dtype": "auto"},
                "rtol": 0.05,
                "atol": 0.05,
            }
        )
    )
    return path


def scores(recall, ppl, recall_err=0.05):
    return {
        "hybridkv_niah_4k": {
            "niah_recall,none": recall,
            "niah_recall_stderr,none": recall_err,
        },
        "hybridkv_corpus_ppl": {
            "word_perplexity,none": ppl,
            "word_perplexity_stderr,none": "N/A",
        },
    }


@pytest.fixture
def jobs(tmp_path):
    """Three jobs of one model: one shared baseline, three candidates."""
    configs = [
        write_job(tmp_path / f"M-{kv}.yaml", kv)
        for kv in ("turboquant_k8v4", "turboquant_4bit_nc", "fp8")
    ]
    listing = tmp_path / "models-test.txt"
    listing.write_text("".join(f"{c.name}\n" for c in configs))
    return listing, configs


@pytest.fixture
def fake_side(tmp_path, monkeypatch):
    stamps = tmp_path / "stamps"
    script = tmp_path / "fake_side.py"
    script.write_text(FAKE_SIDE)

    def command(config_file, role, tp_size, out):
        return [
            sys.executable,
            str(script),
            str(config_file),
            role,
            str(out),
            str(stamps),
        ]

    monkeypatch.setattr(sides, "command", command)
    monkeypatch.setenv(
        "FAKE_SIDE_SCORES",
        json.dumps({"baseline": scores(0.9, 30.0), "candidate": scores(0.9, 30.3)}),
    )
    return stamps


def test_plan_runs_a_shared_baseline_once_and_skips_finished_runs(jobs, tmp_path):
    _, configs = jobs
    results = tmp_path / "results"
    todo = sides.plan(configs, 1, results)
    assert [s.role for s in todo] == ["baseline", "candidate", "candidate", "candidate"]
    assert len({s.key for s in todo}) == 4
    assert all(s.out == results / f"{s.key}.json" for s in todo)
    results.mkdir()
    todo[1].out.write_text("{}")
    assert [s.key for s in sides.plan(configs, 1, results)] == [
        todo[0].key,
        todo[2].key,
        todo[3].key,
    ]
    # Another tensor-parallel size is another run.
    assert {s.key for s in sides.plan(configs, 2, results)}.isdisjoint(
        {s.key for s in todo}
    )


@pytest.mark.parametrize(
    "gpus,tp,expected",
    [
        (None, 1, [None]),
        ([], 1, [None]),
        (["0"], 1, ["0"]),
        (["0", "1", "2"], 1, ["0", "1", "2"]),
        (["0", "1", "2", "3"], 2, ["0,1", "2,3"]),
        (["4", "5", "6"], 2, ["4,5"]),
    ],
)
def test_device_groups(gpus, tp, expected):
    assert sides.device_groups(gpus, tp) == expected


def test_device_groups_too_few_gpus():
    with pytest.raises(ValueError, match="1 GPUs .* tensor-parallel size 2"):
        sides.device_groups(["0"], 2)


def test_run_all_bounds_concurrency_and_spreads_gpus(jobs, tmp_path, fake_side):
    _, configs = jobs
    todo = sides.plan(configs, 1, tmp_path / "results")
    lines = []
    failed = sides.run_all(
        todo, 1, max_parallel=2, gpus=["0", "1"], echo=lines.append, poll_seconds=0.05
    )
    assert failed == []
    assert all(s.out.is_file() and s.returncode == 0 for s in todo)
    runs = [json.loads((fake_side / s.key).read_text()) for s in todo]
    # Never more than two at once: at any run's start, at most one other is running.
    for r in runs:
        overlapping = [o for o in runs if o["start"] <= r["start"] < o["end"]]
        assert len(overlapping) <= 2
    # The first two start together, on different GPUs.
    assert {runs[0]["devices"], runs[1]["devices"]} == {"0", "1"}
    assert all(r["devices"] in ("0", "1") for r in runs)
    # Each side's output is in its log, next to its scores.
    assert "fake baseline" in todo[0].log.read_text()
    assert sum(line.startswith("start ") for line in lines) == 4
    assert sum(line.startswith("done ") for line in lines) == 4


def test_run_all_leaves_devices_alone_without_gpus(
    jobs, tmp_path, fake_side, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    _, configs = jobs
    todo = sides.plan(configs[:1], 1, tmp_path / "results")
    assert sides.run_all(todo, 1, max_parallel=4, echo=lambda _: None) == []
    assert json.loads((fake_side / todo[0].key).read_text())["devices"] == "7"


def test_run_all_staggers_starts(jobs, tmp_path, fake_side, monkeypatch):
    """The runner spaces the instants it starts the sides. Timed where it
    starts them: when each side's interpreter reaches its first line depends
    on the machine's load (a loaded 2-core CI box read gaps under 0.25 s)."""
    monkeypatch.setenv("FAKE_SIDE_SECONDS", "0")
    launched = []
    popen = sides.subprocess.Popen

    def timed_popen(*args, **kwargs):
        launched.append(time.monotonic())
        return popen(*args, **kwargs)

    monkeypatch.setattr(sides.subprocess, "Popen", timed_popen)
    _, configs = jobs
    todo = sides.plan(configs, 1, tmp_path / "results")
    sides.run_all(
        todo,
        1,
        max_parallel=4,
        echo=lambda _: None,
        poll_seconds=0.05,
        stagger_seconds=0.3,
    )
    assert len(launched) == 4
    assert all(b - a >= 0.3 for a, b in zip(launched, launched[1:]))


def test_failed_side_is_reported_with_its_log(jobs, tmp_path, fake_side, monkeypatch):
    listing, configs = jobs
    monkeypatch.setenv(
        "FAKE_SIDE_SCORES",
        json.dumps(
            {
                "baseline": scores(0.9, 30.0),
                "candidate": scores(0.9, 30.3),
                "M-fp8:candidate": "crash",
            }
        ),
    )
    results = tmp_path / "results"
    todo = sides.plan(configs, 1, results)
    lines = []
    failed = sides.run_all(
        todo, 1, max_parallel=4, echo=lines.append, poll_seconds=0.05
    )
    assert [(s.config_file.name, s.role, s.returncode) for s in failed] == [
        ("M-fp8.yaml", "candidate", 3)
    ]
    assert any(line.startswith("FAILED M-fp8 candidate") for line in lines)
    assert "fake candidate" in sides.log_tail(failed[0].log)

    # The job whose engine failed fails with that log; the others compare.
    runner = _runner()
    parallel = {s.key: s for s in failed}
    fp8 = job_config.load(configs[2])
    with pytest.raises(
        AssertionError, match=r"(?s)candidate engine .*exited 3.*fake candidate"
    ):
        runner.run_side(configs[2], fp8, "candidate", 1, results, parallel)
    k8v4 = job_config.load(configs[0])
    assert runner.run_side(
        configs[0], k8v4, "candidate", 1, results, parallel
    ) == scores(0.9, 30.3)

    # The report names the run that is missing and exits non-zero.
    lines, ok = report.report(listing, results)
    assert not ok
    assert any(line.startswith("M-fp8: no scores yet for candidate") for line in lines)


def test_scores_written_before_a_teardown_abort_are_kept(
    jobs, tmp_path, fake_side, monkeypatch
):
    """An engine that wrote its scores and then aborted on the way out (exit -6)
    finished its measurement: the job compares them, and the runner says so."""
    monkeypatch.setenv(
        "FAKE_SIDE_SCORES",
        json.dumps(
            {
                "baseline": scores(0.9, 30.0),
                "candidate": scores(0.9, 30.3),
                "M-fp8:candidate": "abort-after-scores",
            }
        ),
    )
    results = tmp_path / "results"
    todo = sides.plan(jobs[1], 1, results)
    lines = []
    failed = sides.run_all(
        todo, 1, max_parallel=4, echo=lines.append, poll_seconds=0.05
    )
    assert failed == []
    aborted = [s for s in todo if s.returncode not in (0, None)]
    assert [(s.config_file.name, s.role) for s in aborted] == [
        ("M-fp8.yaml", "candidate")
    ]
    assert aborted[0].ended_after_scores
    assert any(
        line.startswith("done M-fp8 candidate") and "after writing its scores" in line
        for line in lines
    )
    lines, ok = report.report(jobs[0], results)
    assert ok, lines


def test_report_lines_and_markdown(jobs, tmp_path, fake_side):
    listing, configs = jobs
    results = tmp_path / "results"
    sides.run_all(sides.plan(configs, 1, results), 1, 4, echo=lambda _: None)
    lines, ok = report.report(listing, results)
    assert ok and len(lines) == 6  # 3 jobs x 2 metrics
    assert lines[0].startswith(
        "M-turboquant_k8v4: hybridkv_niah_4k | niah_recall,none:"
    )
    assert lines[0].endswith("[stderr baseline 0.0500, candidate 0.0500]")
    assert (
        "word_perplexity,none: baseline=30.0000 | candidate=30.3000 (+1.00%)"
        in lines[1]
    )
    assert "max=30.6000" in lines[1] and lines[1].endswith("| ok")
    table, ok = report.report(listing, results, markdown=True)
    assert table[0] == report.MARKDOWN_HEADER
    assert table[2] == (
        "| M-turboquant_k8v4 | turboquant_k8v4 | hybridkv_corpus_ppl | "
        "word_perplexity,none | 30.0000 | 30.3000 | +1.00% | <= 30.6000 | ok |"
    )
    assert "| 0.9000 ± 0.0500 | 0.9000 ± 0.0500 |" in table[1]
    assert (
        report.main(["--config-list-file", str(listing), "--results-dir", str(results)])
        == 0
    )


def test_report_fails_on_a_candidate_beyond_tolerance(
    jobs, tmp_path, fake_side, monkeypatch
):
    listing, configs = jobs
    monkeypatch.setenv(
        "FAKE_SIDE_SCORES",
        json.dumps({"baseline": scores(0.9, 30.0), "candidate": scores(0.9, 31.0)}),
    )
    results = tmp_path / "results"
    sides.run_all(sides.plan(configs, 1, results), 1, 4, echo=lambda _: None)
    lines, ok = report.report(listing, results)
    assert not ok and sum(line.endswith("| FAIL") for line in lines) == 3


def _runner():
    spec = importlib.util.spec_from_file_location(
        "_hkv_lm_eval_runner_sides", HARNESS / "test_lm_eval_correctness.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_key_is_the_sides_key(jobs):
    _, configs = jobs
    config = job_config.load(configs[0])
    assert _runner()._side_key(config, "baseline", 1) == sides.side_key(
        config, "baseline", 1
    )
