# SPDX-License-Identifier: Apache-2.0
"""check/apply against vLLM trees: the pinned base applies, anything else is refused."""

import json
import re

import pytest

from hybridkv import tree
from hybridkv.base import load_base
from hybridkv.tree import MANIFEST, Refusal, plan, report, write


def test_every_patch_applies_to_pristine(pristine_root, series):
    pl = plan(pristine_root, series)
    assert [r.status for r in pl.results] == ["APPLIED"] * len(series.patches)
    lines = []
    assert report(pl, out=lines.append) == 0
    assert lines[-1].startswith(f"Passed validation ({len(series.patches)} patches)")


def test_apply_is_idempotent(small_tree, series):
    write(plan(small_tree, series), series, load_base())
    before = {p: (small_tree / p).read_bytes() for p in series.hooked_files()}
    again = plan(small_tree, series)
    assert {r.status for r in again.results} == {"ALREADY-APPLIED"}
    write(again, series, load_base())
    assert before == {p: (small_tree / p).read_bytes() for p in series.hooked_files()}
    assert (small_tree / MANIFEST).exists()
    for rel in series.overlay_files():
        assert (small_tree / rel).read_bytes() == (series.repo / rel).read_bytes()


def test_another_vllm_version_is_refused_with_both_versions(small_tree, series):
    meta = next(small_tree.glob("vllm-*.dist-info")) / "METADATA"
    meta.write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.21.0", meta.read_text()))
    with pytest.raises(Refusal) as exc:
        plan(small_tree, series)
    msg = str(exc.value)
    assert "made for vLLM 0.20.2" in msg and "holds vLLM 0.21.0" in msg
    assert "pip install vllm==0.20.2" in msg


def test_a_drifted_file_fails_naming_file_and_hashes(small_tree, series):
    rel = series.hooked_files()[0]
    with open(small_tree / rel, "a") as f:
        f.write("# a local edit\n")
    pl = plan(small_tree, series)
    lines = []
    assert report(pl, out=lines.append) == 1
    text = "\n".join(lines)
    assert "FAILED" in text and "file-drifted" in text and rel in text
    assert "neither vLLM 0.20.2's" in text
    assert lines[-1] == "FAILED VALIDATION; see above"


def test_an_overlay_path_taken_by_upstream_fails(small_tree, series):
    rel = next(iter(series.overlay_files()))
    (small_tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (small_tree / rel).write_text("# upstream's own file\n")
    pl = plan(small_tree, series)
    assert any("overlay-shadows-upstream" in r.reasons for r in pl.results)


def _snapshot(root):
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_check_finds_a_deleted_overlay_module(small_tree, series):
    write(plan(small_tree, series), series, load_base())
    # Imported by 0004's hook in kv_cache_utils.
    rel = "vllm/v1/core/kv_cache_page_unify.py"
    (small_tree / rel).unlink()
    pl = plan(small_tree, series)
    lines = []
    assert report(pl, out=lines.append) == 1
    text = "\n".join(lines)
    assert "overlay-missing" in text and rel in text


def test_check_finds_a_modified_overlay_module(small_tree, series):
    write(plan(small_tree, series), series, load_base())
    rel = next(iter(series.overlay_files()))
    with open(small_tree / rel, "a") as f:
        f.write("# local edit\n")
    pl = plan(small_tree, series)
    assert not pl.ok
    assert any("overlay-modified" in r.reasons for r in pl.results)


def test_check_finds_a_missing_or_stale_manifest(small_tree, series):
    write(plan(small_tree, series), series, load_base())
    manifest = small_tree / MANIFEST
    data = json.loads(manifest.read_text())
    data["release"] = 1
    manifest.write_text(json.dumps(data))
    pl = plan(small_tree, series)
    assert not pl.ok and any(p.startswith("manifest-stale") for p in pl.problems)
    data["overlay"].append("vllm/v1/old_release_module.py")
    (small_tree / "vllm/v1/old_release_module.py").write_text("# old\n")
    manifest.write_text(json.dumps(data))
    assert any(p.startswith("overlay-extra") for p in plan(small_tree, series).problems)
    manifest.unlink()
    assert any(
        p.startswith("manifest-missing") for p in plan(small_tree, series).problems
    )


@pytest.mark.parametrize("fail_at", ["stage", "commit"])
def test_apply_is_all_or_nothing(small_tree, series, monkeypatch, fail_at):
    """A write failing midway leaves the tree byte for byte as it was."""
    before = _snapshot(small_tree)
    calls = []
    real = {"stage": tree._stage, "commit": tree._commit}[fail_at]

    def flaky(*args):
        calls.append(args)
        if len(calls) == 10:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(tree, f"_{fail_at}", flaky)
    with pytest.raises(
        tree.ApplyError, match="No space left on device.*Nothing was changed"
    ):
        write(plan(small_tree, series), series, load_base())
    assert len(calls) == 10
    assert _snapshot(small_tree) == before
    monkeypatch.undo()
    assert [r.status for r in plan(small_tree, series).results] == ["APPLIED"] * len(
        series.patches
    )


def test_installed_ignores_a_vllm_folder_without_dist_info(tmp_path, small_tree):
    """`check --installed` run from the repository root: its vllm/ is no install."""
    checkout = tmp_path / "checkout"
    (checkout / "vllm").mkdir(parents=True)
    (checkout / "vllm" / "__init__.py").write_text("")
    (small_tree / "vllm" / "__init__.py").write_text("")
    assert tree.installed_root([str(checkout), str(small_tree)]) == small_tree.resolve()
    with pytest.raises(Refusal, match="no installed vllm"):
        tree.installed_root([str(checkout)])
