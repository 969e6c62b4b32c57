# SPDX-License-Identifier: Apache-2.0
"""check/apply against vLLM trees: the pinned base applies, anything else is refused."""

import re

import pytest

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
