# SPDX-License-Identifier: Apache-2.0
"""hybridkv.testing.pytest_plugin on a CPU run: vLLM's per-test teardown
without its full garbage collection."""

import re

import pytest

import vllm.distributed
from vllm import envs

pytest_plugins = ("pytester",)
FULL = re.compile(r"FULL \[.*\]")

# vLLM 0.20.2's tests/conftest.py, as far as these tests need it: the autouse
# teardown and the fixture that lets a test opt out of it.
UPSTREAM_CONFTEST = """
import pytest

FULL = []


@pytest.fixture()
def should_do_global_cleanup_after_test(request) -> bool:
    return not request.node.get_closest_marker("skip_global_cleanup")


@pytest.fixture(autouse=True)
def cleanup_fixture(request, should_do_global_cleanup_after_test: bool):
    yield
    if should_do_global_cleanup_after_test:
        FULL.append(request.node.name)
"""

TESTS = """
import pytest


def test_plain():
    pass


@pytest.mark.skip_global_cleanup
def test_marked_by_its_author():
    pass


def test_full_cleanups_so_far():
    import conftest

    print("FULL", conftest.FULL)
"""


@pytest.fixture
def light(monkeypatch):
    """Names of the tests whose light teardown ran (the parts of vLLM's
    cleanup that do not force a collection), recorded where it calls vLLM."""
    calls = []
    for module, name in (
        (envs, "disable_envs_cache"),
        (vllm.distributed, "destroy_model_parallel"),
        (vllm.distributed, "destroy_distributed_environment"),
    ):
        monkeypatch.setattr(module, name, lambda name=name: calls.append(name))
    return calls


def _run(pytester, *args):
    pytester.makeconftest(UPSTREAM_CONFTEST)
    pytester.makepyfile(test_cleanup=TESTS)
    result = pytester.runpytest_inprocess(
        "-p", "hybridkv.testing.pytest_plugin", "-s", "-q", "-p", "no:randomly", *args
    )
    result.assert_outcomes(passed=3)
    full = [m.group() for m in map(FULL.search, result.outlines) if m]
    assert len(full) == 1, result.outlines
    return full[0]


def test_cpu_run_skips_the_full_collection_and_keeps_the_rest(pytester, light):
    full = _run(pytester)
    # Upstream's teardown, with its gc.collect(), ran for no test.
    assert full == "FULL []"
    # The rest of it ran after each of the two tests the plugin lightened
    # (the last one's after the print), not after the one vLLM's author marked.
    assert (
        light
        == [
            "disable_envs_cache",
            "destroy_model_parallel",
            "destroy_distributed_environment",
        ]
        * 2
    )


def test_full_cleanup_keeps_vllms_teardown_as_written(pytester, light):
    full = _run(pytester, "--full-cleanup")
    assert full == "FULL ['test_plain']"
    assert light == []


REDIRECTED = """
import os


def test_the_stand_ins_exist_while_the_session_runs():
    assert os.path.isfile(os.environ["VLLM_MODEL_REDIRECT_PATH"])
    assert os.path.isdir(os.environ["HF_HUB_CACHE"])
    made = os.environ["VLLM_MODEL_REDIRECT_PATH"], os.environ["HF_HUB_CACHE"]
    print("STAND-INS", *made)
"""


def test_model_redirect_leaves_nothing_in_tmpdir(pytester, monkeypatch):
    models = pytester.mkdir("models")
    (models / "org" / "name").mkdir(parents=True)
    (models / "org" / "name" / "config.json").write_text("{}")
    tmpdir = pytester.mkdir("tmp")
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    pytester.makepyfile(test_redirected=REDIRECTED)
    result = pytester.runpytest_subprocess(
        "-p", "hybridkv.testing.pytest_plugin", f"--model-redirect-dir={models}", "-s"
    )
    result.assert_outcomes(passed=1)
    made = next(line for line in result.outlines if "STAND-INS" in line)
    made = made.split("STAND-INS")[1].split()
    # Made in TMPDIR, so the check below looks where they were.
    assert len(made) == 2 and all(p.startswith(str(tmpdir)) for p in made), made
    assert sorted(p.name for p in tmpdir.iterdir()) == []
