# SPDX-License-Identifier: Apache-2.0
"""The patched wheel's requirements: what pip installs from a fresh environment.

With vLLM 0.20.2's own METADATA, pip settles on xgrammar 0.2.5.post1 (which caps
transformers < 5) and so on transformers 4.57.6, which does not know Gemma 4.
``requirements/wheel-requires.txt`` steers the resolver; the resolution test asks
PyPI (``pip install --dry-run --ignore-installed --report``, about 1-2 minutes)
what a fresh ``pip install`` of the wheel gets and checks those versions.
Set ``HYBRIDKV_SKIP_RESOLVE=1`` to skip it on a machine without PyPI.
"""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from hybridkv.base import REPO, downloads_dir, load_base
from hybridkv.wheel import load_requires, steer_requirements

# The transformers release line the wheel steers to (requirements/wheel-requires.txt
# says why); CI also parses every model config under 5.17 and 5.23.0.
GPU_TESTED_TRANSFORMERS = "5.17"


def _pristine_wheel() -> Path:
    return next(downloads_dir().glob("vllm-*.whl"))


def _pristine_metadata() -> bytes:
    base = load_base()
    with zipfile.ZipFile(_pristine_wheel()) as z:
        return z.read(f"{base.project}-{base.version}.dist-info/METADATA")


def _requires(metadata: bytes) -> dict[str, str]:
    lines = re.findall(r"^Requires-Dist: (.*)$", metadata.decode(), re.M)
    return {Requirement(ln).name.lower(): ln for ln in lines if "extra ==" not in ln}


def test_metadata_steers_only_the_listed_requirements(pristine_root):
    pristine = _pristine_metadata()
    steered = steer_requirements(pristine, load_requires())
    before, after = _requires(pristine), _requires(steered)
    changed = {name for name in before if before[name] != after[name]}
    assert changed == set(load_requires())
    assert set(before) == set(after)
    # Gemma 4 is known to transformers only from 5.x; the wheel must not allow 4.x.
    assert not Requirement(after["transformers"]).specifier.contains("4.57.6")
    # Extras keep their own pins.
    extras = [ln for ln in steered.decode().splitlines() if "extra ==" in ln]
    assert extras == [ln for ln in pristine.decode().splitlines() if "extra ==" in ln]


def test_a_requirement_pristine_lacks_is_refused(pristine_root):
    with pytest.raises(SystemExit, match="no Requires-Dist for not-a-vllm-dep"):
        steer_requirements(
            _pristine_metadata(), {"not-a-vllm-dep": "not-a-vllm-dep>=1"}
        )


def _wheel_to_resolve(tmp_path: Path) -> Path:
    """The built wheel of this release if there is one, else its METADATA alone.

    Resolution reads only the METADATA, so a wheel holding just the dist-info
    (with the real wheel's name and tags) resolves exactly as the built one.
    """
    base = load_base()
    built = sorted((REPO / "dist").glob(f"{base.project}-{base.label}-*.whl"))
    if built:
        return built[-1]
    pristine = _pristine_wheel()
    info = f"{base.project}-{base.label}.dist-info"
    metadata = re.sub(
        rb"^Version: .*$",
        f"Version: {base.label}".encode(),
        _pristine_metadata(),
        count=1,
        flags=re.M,
    )
    tags = pristine.name[len(f"{base.project}-{base.version}-") :]
    target = tmp_path / f"{base.project}-{base.label}-{tags}"
    with zipfile.ZipFile(pristine) as src, zipfile.ZipFile(target, "w") as dst:
        dst.writestr(f"{info}/METADATA", steer_requirements(metadata, load_requires()))
        dst.writestr(
            f"{info}/WHEEL", src.read(f"{base.project}-{base.version}.dist-info/WHEEL")
        )
        dst.writestr(f"{info}/RECORD", "")
    return target


@pytest.mark.skipif(
    os.environ.get("HYBRIDKV_SKIP_RESOLVE") == "1", reason="HYBRIDKV_SKIP_RESOLVE=1"
)
def test_fresh_install_resolves_a_set_that_runs_gemma4(tmp_path, pristine_root):
    wheel = _wheel_to_resolve(tmp_path)
    report = tmp_path / "report.json"
    # PyPI only, as a user's plain `pip install` sees it: no local wheel folders or
    # extra indexes from this machine's pip configuration.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") or k == "PIP_CERT"
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--disable-pip-version-check",
            "--quiet",
            "--index-url",
            "https://pypi.org/simple",
            "--report",
            str(report),
            str(wheel),
        ],
        check=True,
        env=env,
        timeout=900,
    )
    installed = {
        item["metadata"]["name"].lower(): item["metadata"]
        for item in json.loads(report.read_text())["install"]
    }
    versions = {name: Version(meta["version"]) for name, meta in installed.items()}
    print(
        {
            k: str(versions[k])
            for k in (
                "vllm",
                "transformers",
                "xgrammar",
                "apache-tvm-ffi",
                "tokenizers",
                "torch",
            )
        }
    )

    assert versions["vllm"] == Version(load_base().label)
    transformers = versions["transformers"]
    assert transformers.release[:2] == Version(GPU_TESTED_TRANSFORMERS).release[:2]
    assert versions["xgrammar"] >= Version("0.2.6")
    # vLLM 0.20.2's CUDA stack stays as published.
    assert versions["torch"] == Version("2.11.0")
    assert versions["flashinfer-python"] == Version("0.6.8.post1")
    # Every resolved package's own requirements hold (pip guarantees it; this
    # states the pairs that broke before).
    for name in ("xgrammar", "flashinfer-python", "tilelang"):
        for line in installed[name].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if req.name.lower() in versions:
                assert req.specifier.contains(
                    versions[req.name.lower()], prereleases=True
                ), (name, line, versions[req.name.lower()])
