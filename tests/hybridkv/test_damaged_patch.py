# SPDX-License-Identifier: Apache-2.0
"""A patch file cut short fails by name in `check` and `apply`, and writes nothing."""

import os
import re
import subprocess
import sys

import pytest

from hybridkv.base import cache_dir


def _cut_last_hunk(patch_file, lines_removed=3):
    """Remove the file's last lines; return the last hunk's header and what stays."""
    lines = patch_file.read_text().splitlines(keepends=True)[:-lines_removed]
    patch_file.write_text("".join(lines))
    at = max(i for i, line in enumerate(lines) if line.startswith("@@ "))
    body = [line[:1] for line in lines[at + 1 :]]
    old = sum(tag in " -" for tag in body)
    new = sum(tag in " +" for tag in body)
    return lines[at], old, new


def _hybridkv(checkout, *args):
    env = {**os.environ, "HYBRIDKV_CACHE": str(cache_dir())}
    return subprocess.run(
        [sys.executable, "-m", "hybridkv", *args],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("command", ["check", "apply"])
def test_a_patch_cut_short_fails_check_and_apply_by_name(
    repo_copy, small_tree, series, command
):
    last = series.patches[-1]
    header, old, new = _cut_last_hunk(repo_copy / "patches" / last.name)
    counts = re.match(r"@@ -\d+,(\d+) \+\d+,(\d+) @@", header)
    hunk = sum(len(d.hunks) for d in last.diffs if d.path == last.diffs[-1].path)
    before = {p: (small_tree / p).read_bytes() for p in series.hooked_files()}

    out = _hybridkv(repo_copy, command, "--tree", str(small_tree))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Passed validation" not in text
    assert f"{last.diffs[-1].path} hunk {hunk} ({header.split(' @@')[0]} @@" in text
    assert f"promises {counts.group(1)} old and {counts.group(2)} new lines" in text, (
        text
    )
    assert f"has {old} old and {new} new lines before the end of the patch" in text
    assert text.rstrip().endswith("FAILED VALIDATION; see above")
    assert before == {p: (small_tree / p).read_bytes() for p in series.hooked_files()}
    assert not (small_tree / "vllm" / "_hybridkv_manifest.json").exists()
