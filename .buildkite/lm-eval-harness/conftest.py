# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from pathlib import Path

import pytest
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


@pytest.fixture(scope="session")
def tp_size(pytestconfig) -> int:
    return int(pytestconfig.getoption("--tp-size"))


@pytest.fixture(scope="session")
def results_dir(pytestconfig, tmp_path_factory) -> Path:
    given = pytestconfig.getoption("--results-dir")
    path = Path(given) if given else tmp_path_factory.mktemp("lm-eval-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def pytest_generate_tests(metafunc):
    if "config_filename" in metafunc.fixturenames:
        list_file = metafunc.config.getoption("--config-list-file")
        if not list_file:
            raise pytest.UsageError(
                "--config-list-file is required (e.g. configs/models-tiny.txt)"
            )
        configs = read_config_list(Path(list_file).resolve())
        metafunc.parametrize("config_filename", configs, ids=[c.stem for c in configs])
