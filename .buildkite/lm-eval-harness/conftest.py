# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from pathlib import Path

import pytest
from hybridkv_lm_eval import sides
from hybridkv_lm_eval.config import read_config_list


def pytest_addoption(parser):
    parser.addoption(
        "--config-list-file",
        action="store",
        help="file listing the job config YAMLs to run (one per line, relative to it)",
    )
    parser.addoption(
        "--tp-size",
        action="store",
        default="1",
        help="tensor parallel size of both engines",
    )
    parser.addoption(
        "--results-dir",
        action="store",
        default=None,
        help="where each engine's scores are written (JSON); a baseline whose "
        "settings, tasks and limits match one already there is reused "
        "(default: a temp dir)",
    )
    parser.addoption(
        "--jobs",
        action="store",
        type=int,
        default=1,
        help="engine processes to run at once (default 1: each job's engines one "
        "after the other). Above 1, the distinct engine runs of all selected jobs "
        "start first, this many at a time, each logging to <results-dir>/<key>.log; "
        "the jobs' engines must then fit beside each other (a fixed "
        "kv_cache_memory_bytes and a small gpu_memory_utilization)",
    )
    parser.addoption(
        "--gpus",
        action="store",
        default=None,
        help="with --jobs: comma-separated GPU ids to spread the engines over "
        "(--tp-size of them each, the least busy first); default: leave "
        "CUDA_VISIBLE_DEVICES alone",
    )
    parser.addoption(
        "--stagger",
        action="store",
        type=float,
        default=2.0,
        help="with --jobs: seconds between two engine starts (default 2)",
    )


@pytest.fixture(scope="session")
def tp_size(pytestconfig) -> int:
    return int(pytestconfig.getoption("--tp-size"))


@pytest.fixture(scope="session")
def results_dir(pytestconfig, tmp_path_factory) -> Path:
    given = pytestconfig.getoption("--results-dir")
    path = Path(given) if given else tmp_path_factory.mktemp("lm-eval-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def parallel_sides(request, tp_size, results_dir) -> dict[str, sides.Side]:
    """With --jobs > 1: run every selected job's engines up front, several at once;
    the sides that failed, by key (empty otherwise, or when none failed)."""
    jobs = request.config.getoption("--jobs")
    if jobs <= 1:
        return {}
    gpus = request.config.getoption("--gpus")
    configs = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec and "config_filename" in callspec.params:
            configs.append(callspec.params["config_filename"])
    todo = sides.plan(configs, tp_size, results_dir)
    print(
        f"\n{len(todo)} engine runs for {len(configs)} jobs, {jobs} at a time "
        f"(scores and logs in {results_dir})",
        flush=True,
    )
    failed = sides.run_all(
        todo,
        tp_size,
        max_parallel=jobs,
        gpus=[g.strip() for g in gpus.split(",") if g.strip()] if gpus else None,
        echo=lambda line: print(line, flush=True),
        stagger_seconds=request.config.getoption("--stagger"),
    )
    return {s.key: s for s in failed}


def pytest_generate_tests(metafunc):
    if "config_filename" in metafunc.fixturenames:
        list_file = metafunc.config.getoption("--config-list-file")
        if not list_file:
            raise pytest.UsageError(
                "--config-list-file is required (e.g. configs/models-tiny.txt)"
            )
        configs = read_config_list(Path(list_file).resolve())
        metafunc.parametrize("config_filename", configs, ids=[c.stem for c in configs])
