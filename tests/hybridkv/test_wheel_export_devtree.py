# SPDX-License-Identifier: Apache-2.0
"""The patched wheel, the upstream export and the dev-tree round trip."""

import base64
import csv
import hashlib
import io
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from hybridkv.base import REPO, downloads_dir, load_base
from hybridkv.devtree import dev, refresh
from hybridkv.export import dependencies, own_diff, pr_description
from hybridkv.series import load_series, static_problems
from hybridkv.wheel import build


@pytest.fixture(scope="module")
def patched_wheel(pristine_root, tmp_path_factory):
    pristine = next(downloads_dir().glob("vllm-*.whl"))
    return build(
        pristine, load_series(), tmp_path_factory.mktemp("dist"), log=lambda *_: None
    )


def test_wheel_carries_the_label_and_a_true_record(patched_wheel):
    base = load_base()
    assert patched_wheel.name.startswith(f"vllm-{base.label}-")
    with zipfile.ZipFile(patched_wheel) as z:
        info = f"vllm-{base.label}.dist-info"
        assert f"Version: {base.label}" in z.read(f"{info}/METADATA").decode()
        rows = list(csv.reader(io.StringIO(z.read(f"{info}/RECORD").decode())))
        recorded = {r[0] for r in rows}
        assert recorded == set(z.namelist())
        for name, digest, size in rows:
            if name.endswith(".py") or name.endswith(".json"):
                data = z.read(name)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                    b"="
                )
                assert digest == f"sha256={want.decode()}" and int(size) == len(data), (
                    name
                )
        series = load_series()
        for rel in series.overlay_files():
            assert z.read(rel) == (REPO / rel).read_bytes()
        assert "vllm/_hybridkv_manifest.json" in recorded


def test_each_own_diff_applies_once_its_dependencies_landed(
    tmp_path, pristine_root, series
):
    for patch in series.patches:
        diff = own_diff(patch, series, pristine_root)
        tree = tmp_path / patch.name.replace("/", "_")
        stack = dependencies(patch, series)
        for p in [*stack, patch]:
            for d in p.diffs:
                (tree / d.path).parent.mkdir(parents=True, exist_ok=True)
                if not (tree / d.path).exists():
                    shutil.copyfile(pristine_root / d.path, tree / d.path)
        # A stacked PR's own commit applies once the PRs it names in Depends:
        # have landed.
        for dep in stack:
            (tree / "dep.diff").write_text(own_diff(dep, series, pristine_root))
            subprocess.run(["git", "apply", "dep.diff"], cwd=tree, check=True)
        (tree / "pr.diff").write_text(diff)
        subprocess.run(["git", "apply", "--check", "pr.diff"], cwd=tree, check=True)
        desc = pr_description(patch, series)
        if stack:
            assert "Depends on (land first)" in desc
            stem = Path(patch.name).stem
            assert f"{stem}.diff is this branch against vLLM 0.20.2" in desc
            assert all(dep.name in desc for dep in stack)
        for rel in patch.listed("Overlay") + patch.listed("Tests"):
            assert f"+++ b/{rel}" in diff
        assert desc.startswith(f"# {patch.subject}\n")
        # A patch with an upstream bug (DEP-3 `Bug:`) names it the way vLLM PRs
        # do; one that fixes only a hybridkv issue (e.g. the store speed-up, the
        # GPU-less CLI) claims no upstream issue rather than a made-up one.
        bug = patch.fields.get("Bug", "")
        upstream = re.search(r"/vllm-project/vllm/issues/(\d+)", bug)
        if upstream:
            assert re.search(
                rf"^Fixes .*vllm-project/vllm#{upstream.group(1)}\b", desc, re.M
            ), (patch.name, upstream.group(1))
        # vLLM's DCO check: the description ends with the author's sign-off.
        assert (
            desc.rstrip().splitlines()[-1] == f"Signed-off-by: {patch.fields['From']}"
        )


def test_dev_then_refresh_reproduces_the_series(tmp_path, pristine_root, series):
    dev(series, tmp_path / "dev", log=lambda *_: None)
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "patches", copy / "patches")
    for rel in list(series.overlay_files()) + [
        t for p in series.patches for t in p.listed("Tests")
    ]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
    refresh(tmp_path / "dev", copy, log=lambda *_: None)
    for patch in series.patches:
        assert (copy / "patches" / patch.name).read_text() == patch.text
    assert (copy / "patches" / "pristine.sha256").read_text() == (
        REPO / "patches" / "pristine.sha256"
    ).read_text()


def test_the_series_passes_its_static_checks():
    assert static_problems() == []


def test_static_checks_catch_an_unlisted_patch(tmp_path):
    shutil.copytree(REPO / "patches", tmp_path / "patches")
    shutil.copytree(REPO / "vllm", tmp_path / "vllm")
    shutil.copytree(
        REPO / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "patches" / "core" / "9999-stray.patch").write_text("x\n")
    assert (
        "patches/core/9999-stray.patch: not listed in patches/series"
        in static_problems(tmp_path)
    )


def test_refresh_refuses_a_commit_that_edits_another_patchs_file(
    tmp_path, pristine_root, series
):
    dev(series, tmp_path / "dev", log=lambda *_: None)
    overlay = next(iter(series.overlay_files()))
    with open(tmp_path / "dev" / overlay, "a") as f:
        f.write("# a later fix\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(
        git + ["commit", "-qam", "fix the overlay"], cwd=tmp_path / "dev", check=True
    )
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "patches", copy / "patches")
    with pytest.raises(
        SystemExit, match=rf"changes {overlay}, which an earlier commit added"
    ):
        refresh(tmp_path / "dev", copy, log=lambda *_: None)


def test_every_exported_diff_applies_to_pristine_alone(tmp_path, small_tree, series):
    """`hybridkv export all`: each .diff is what its pull request shows against
    vLLM 0.20.2, so it applies there on its own, with or without Depends:."""
    from hybridkv.export import export

    out = tmp_path / "export"
    for patch in series.patches:
        export(patch, series, out, log=lambda *_: None)
    failed = {}
    for patch in series.patches:
        diff = out / f"{Path(patch.name).stem}.diff"
        for cmd in (
            ["git", "apply", "--check"],
            ["patch", "-p1", "--dry-run", "-s", "-i"],
        ):
            res = subprocess.run(
                [*cmd, str(diff)], cwd=small_tree, capture_output=True, text=True
            )
            if res.returncode:
                failed[f"{cmd[0]} {diff.name}"] = (res.stdout + res.stderr)[:200]
        stack = dependencies(patch, series)
        own = out / f"{Path(patch.name).stem}.own.diff"
        assert own.exists() == bool(stack), patch.name
        md = diff.with_suffix(".md").read_text()
        assert all(p.name in md for p in stack), patch.name
        for p in [*stack, patch]:
            for rel in p.listed("Overlay") + p.listed("Tests"):
                assert f"+++ b/{rel}\n" in diff.read_text(), (patch.name, rel)
    assert sorted(failed) == [], "\n".join(f"{k}: {v}" for k, v in failed.items())
