# SPDX-License-Identifier: Apache-2.0
"""After an interrupted apply, `check` names what is wrong and the command that
repairs it, and `apply` repairs it: no dead end."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv import cli
from hybridkv.base import REPO, cache_dir, load_base
from hybridkv.tree import MANIFEST, plan, write


def _hybridkv(capsys, argv):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _as_typed(command):
    """Run a printed `hybridkv ...` command line as a user would type it."""
    argv = shlex.split(command)
    script = Path(sys.executable).parent / argv[0]
    prog = [str(script)] if script.exists() else [sys.executable, "-m", "hybridkv"]
    env = {**os.environ, "HYBRIDKV_CACHE": str(cache_dir())}
    out = subprocess.run(
        [*prog, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True
    )
    return out.returncode, out.stdout + out.stderr


def _two_file_patch(series):
    return next(p for p in series.patches if len({d.path for d in p.diffs}) > 1)


def _interrupt(tree, series, pristine_root, damage):
    """Apply the series to ``tree``, then damage it as a killed apply would."""
    write(plan(tree, series), series, load_base())
    if damage == "overlay-deleted":
        (tree / "vllm/v1/core/kv_cache_page_unify.py").unlink()
    elif damage == "manifest-missing":
        (tree / MANIFEST).unlink()
    elif damage == "manifest-stale":
        data = json.loads((tree / MANIFEST).read_text())
        data["release"] -= 1
        data["patches"] = data["patches"][:-1]
        (tree / MANIFEST).write_text(json.dumps(data))
    elif damage == "manifest-unreadable":
        (tree / MANIFEST).write_text('{"release": 2')
    elif damage == "half-written":
        # The files of one patch: the first written, the last not yet.
        paths = list(dict.fromkeys(d.path for d in _two_file_patch(series).diffs))
        shutil.copyfile(pristine_root / paths[-1], tree / paths[-1])
        for p in series.patches:
            if any(d.path == paths[-1] for d in p.diffs):
                for rel in p.listed("Overlay"):
                    (tree / rel).unlink(missing_ok=True)
        (tree / MANIFEST).unlink()


DAMAGE = [
    "overlay-deleted",
    "manifest-missing",
    "manifest-stale",
    "manifest-unreadable",
    "half-written",
]


@pytest.mark.parametrize("damage", DAMAGE)
def test_check_prints_the_command_that_repairs_an_interrupted_apply(
    small_tree, series, pristine_root, capsys, damage
):
    _interrupt(small_tree, series, pristine_root, damage)
    rc, text = _hybridkv(capsys, ["check", "--tree", str(small_tree)])
    assert rc == 1, text
    fix = [line for line in text.splitlines() if line.startswith("To repair: ")]
    assert len(fix) == 1, text
    command = fix[0].removeprefix("To repair: ")
    assert shlex.split(command) == [
        "hybridkv",
        "apply",
        "--tree",
        str(small_tree.resolve()),
    ]
    # The printed command works, and leaves the tree as a fresh apply does.
    rc, text = _as_typed(command)
    assert rc == 0, text
    assert "REPAIRED" in text
    again = plan(small_tree, series)
    assert again.ok and {r.status for r in again.results} == {"ALREADY-APPLIED"}
    fresh = small_tree.parent / "fresh"
    shutil.copytree(small_tree, fresh)
    for rel in series.hooked_files():
        shutil.copyfile(pristine_root / rel, fresh / rel)
    for rel in [*series.overlay_files(), MANIFEST]:
        (fresh / rel).unlink()
    write(plan(fresh, series), series, load_base())
    for rel in [*series.hooked_files(), *series.overlay_files(), MANIFEST]:
        assert (small_tree / rel).read_bytes() == (fresh / rel).read_bytes(), rel


@pytest.mark.parametrize("damage", DAMAGE)
def test_apply_again_repairs_an_interrupted_apply(
    small_tree, series, pristine_root, capsys, damage
):
    _interrupt(small_tree, series, pristine_root, damage)
    rc, text = _hybridkv(capsys, ["apply", "--tree", str(small_tree)])
    assert rc == 0, text
    rc, text = _hybridkv(capsys, ["check", "--tree", str(small_tree)])
    assert rc == 0, text
    assert "Passed validation" in text


def test_a_locally_edited_overlay_file_is_refused_with_a_command_that_works(
    small_tree, series, capsys
):
    write(plan(small_tree, series), series, load_base())
    rel = "vllm/v1/core/kv_cache_page_unify.py"
    with open(small_tree / rel, "a") as f:
        f.write("# a local edit\n")
    rc, text = _hybridkv(capsys, ["apply", "--tree", str(small_tree)])
    assert rc == 1 and "overlay-modified" in text, text
    # apply does not overwrite someone's edit; it says how to put the file back.
    assert (small_tree / rel).read_text().endswith("# a local edit\n")
    restore = f"cp {series.repo / rel} {small_tree.resolve() / rel}"
    assert restore in text, text
    shutil.copyfile(series.repo / rel, small_tree / rel)
    rc, text = _hybridkv(capsys, ["apply", "--tree", str(small_tree)])
    assert rc == 0, text


def test_partially_applied_names_the_files_patched_and_not(
    small_tree, series, pristine_root, capsys
):
    patch = _two_file_patch(series)
    paths = list(dict.fromkeys(d.path for d in patch.diffs))
    write(plan(small_tree, series), series, load_base())
    shutil.copyfile(pristine_root / paths[-1], small_tree / paths[-1])
    rc, text = _hybridkv(capsys, ["check", "--tree", str(small_tree)])
    assert rc == 1
    block = text[text.index(f"FAILED           {patch.name}") :]
    assert "(partially-applied)" in block.splitlines()[0]
    for rel in paths[:-1]:
        assert f"{rel}: patched" in block, block
    assert f"{paths[-1]}: not patched" in block, block
