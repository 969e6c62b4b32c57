# SPDX-License-Identifier: Apache-2.0
"""Exact hunk application: offsets allowed, fuzz never, ambiguity rejected."""

import pytest

from hybridkv.patchfile import PatchFormatError, apply_hunks, locate, parse

PATCH = """\
Subject: [Misc] Rename b
Origin: vendor
Forwarded: no
Last-Update: 2026-11-22
Upstream-Base: 0.20.2
Bug-hybridkv: 1

## Problem
b is badly named.
---
diff --git a/x.py b/x.py
--- a/x.py
+++ b/x.py
@@ -2,3 +2,3 @@
 a = 1
-b = 2
+bee = 2
 c = 3
"""

FILE = ["import os", "a = 1", "b = 2", "c = 3", "d = 4"]


@pytest.fixture
def patch(tmp_path):
    p = tmp_path / "0001-x.patch"
    p.write_text(PATCH)
    return parse(p)


def test_header_body_and_diff_are_read(patch):
    assert patch.subject == "[Misc] Rename b"
    assert patch.fields["Upstream-Base"] == "0.20.2"
    assert patch.body == "## Problem\nb is badly named."
    (d,) = patch.diffs
    assert d.path == "x.py" and len(d.hunks) == 1


def test_applies_and_reverses_exactly(patch):
    hunks = patch.diffs[0].hunks
    new = apply_hunks(FILE, hunks)
    assert new == ["import os", "a = 1", "bee = 2", "c = 3", "d = 4"]
    assert apply_hunks(new, hunks) is None  # not twice
    assert apply_hunks(new, hunks, reverse=True) == FILE


def test_shifted_context_applies_at_its_unique_place(patch):
    shifted = ["# header"] * 5 + FILE
    assert apply_hunks(shifted, patch.diffs[0].hunks)[7] == "bee = 2"


def test_repeated_context_is_an_ambiguous_anchor(patch):
    twice = ["p", "q", "r"] + FILE[1:4] + ["y"] + FILE[1:4]
    res = locate(twice, patch.diffs[0].hunks[0], 0)
    assert (res.status, res.reason) == ("failed", "ambiguous-anchor")


def test_changed_context_is_a_mismatch_showing_both_lines(patch):
    changed = ["import os", "a = 1", "b = 20", "c = 3"]
    res = locate(changed, patch.diffs[0].hunks[0], 0)
    assert res.reason == "context-mismatch"
    assert res.detail == ["line 3: expected 'b = 2'", "line 3: found    'b = 20'"]


def test_a_patch_without_header_separator_is_rejected(tmp_path):
    p = tmp_path / "bad.patch"
    p.write_text(PATCH.replace("---\n", ""))
    with pytest.raises(PatchFormatError, match="no '---' line"):
        parse(p)


def test_a_hunk_cut_short_fails_naming_file_hunk_and_counts(tmp_path):
    """The patch file's last line removed: the hunk's header still promises it."""
    p = tmp_path / "0001-x.patch"
    p.write_text(PATCH[: PATCH.rindex(" c = 3\n")])
    with pytest.raises(PatchFormatError) as exc:
        parse(p)
    msg = str(exc.value)
    assert "x.py hunk 1 (@@ -2,3 +2,3 @@" in msg
    assert "promises 3 old and 3 new lines" in msg
    assert "has 2 old and 2 new lines before the end of the patch" in msg


def test_a_hunk_cut_short_before_the_next_file_fails_by_name(tmp_path):
    second = "diff --git a/y.py b/y.py\n--- a/y.py\n+++ b/y.py\n@@ -1 +1 @@\n-y\n+why\n"
    p = tmp_path / "0001-x.patch"
    p.write_text(PATCH[: PATCH.rindex(" c = 3\n")] + second)
    with pytest.raises(PatchFormatError) as exc:
        parse(p)
    msg = str(exc.value)
    assert "x.py hunk 1 (@@ -2,3 +2,3 @@" in msg and "promises 3 old and 3 new" in msg
    assert "before line 18 ('diff --git a/y.py b/y.py')" in msg


def test_a_hunk_longer_than_its_header_fails_by_name(tmp_path):
    p = tmp_path / "0001-x.patch"
    p.write_text(PATCH + "+d = 4\n")
    with pytest.raises(PatchFormatError) as exc:
        parse(p)
    msg = str(exc.value)
    assert "x.py hunk 1 (@@ -2,3 +2,3 @@" in msg and "promises 3 old and 3 new" in msg
    assert "then line 19 ('+d = 4') still belongs to it" in msg
