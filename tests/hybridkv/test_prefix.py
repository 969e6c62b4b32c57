# SPDX-License-Identifier: Apache-2.0
"""`hybridkv prefix-test`: each patch's tests at its own place in the series."""

import os
import subprocess
import sys
import threading
import time

import pytest

from hybridkv import prefix
from hybridkv.patchfile import apply_hunks, join_lines, read_lines
from hybridkv.prefix import prefix_tree


def test_prefix_tree_holds_exactly_the_first_n_patches(tmp_path, pristine_root, series):
    first = series.patches[0]
    tree = prefix_tree(series, 1, tmp_path / "tree")
    for d in first.diffs:
        want = apply_hunks(read_lines(pristine_root / d.path), d.hunks)
        assert not (tree / d.path).is_symlink()
        assert (tree / d.path).read_bytes() == join_lines(want)
    for rel in first.listed("Overlay"):
        assert (tree / rel).read_bytes() == (series.repo / rel).read_bytes()
    later = [rel for p in series.patches[1:] for rel in p.listed("Overlay")]
    assert later and not any((tree / rel).exists() for rel in later)
    # Everything else is the pristine file, linked rather than copied.
    assert (tree / "vllm" / "__init__.py").resolve() == (
        pristine_root / "vllm" / "__init__.py"
    ).resolve()
    assert next(tree.glob("vllm-*.dist-info")).is_dir()


def test_prefix_tree_writes_nothing_through_a_link(tmp_path, pristine_root, series):
    """A directory no patch writes into is one link to the pristine wheel; no
    file a patch writes has a linked directory above it, so applying the
    whole series leaves the pristine wheel as it was."""
    n = len(series.patches)
    tree = prefix_tree(series, n, tmp_path / "tree")
    written = [d.path for p in series.patches for d in p.diffs]
    written += [rel for p in series.patches for rel in p.listed("Overlay")]
    for rel in written:
        path = tree / rel
        assert path.is_file() and not path.is_symlink(), rel
        assert not any(parent.is_symlink() for parent in path.parents), rel
    untouched = [
        d.name
        for d in (pristine_root / "vllm").iterdir()
        if d.is_dir()
        and d.name != "__pycache__"
        and not any(r.startswith(f"vllm/{d.name}/") for r in written)
    ]
    assert untouched, "every top-level package is patched: pick another check"
    for name in untouched:
        assert (tree / "vllm" / name).is_symlink(), name


def test_jobs_run_patches_at_once_and_print_them_in_series_order(series, monkeypatch):
    """With --jobs 2 two patches' tests run at a time; each one's output is
    held and printed under its own heading, in series order, and a red patch
    is named whatever order the runs end in."""
    running, most, lock = [0], [0], threading.Lock()

    def at_its_place(series_, n, tests, extra, out):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.1 * (4 - n))  # the later patches end first
        print(f"tests of patch {n}", file=out, flush=True)
        with lock:
            running[0] -= 1
        return 1 if n == 2 else 0

    monkeypatch.setattr(prefix, "_at_its_place", at_its_place)
    printed = []
    rc = prefix.run(
        series,
        ["0001", "0002", "0003"],
        [],
        log=lambda *a, end="\n", **k: printed.append(" ".join(a) + end),
        jobs=2,
    )
    text = "".join(printed)
    names = [p.name for p in series.patches[:3]]
    order = [text.index(f"== {names[0]}"), text.index("tests of patch 1")]
    order += [text.index(f"== {names[1]}"), text.index("tests of patch 2")]
    order += [text.index(f"== {names[2]}"), text.index("tests of patch 3")]
    assert order == sorted(order), text
    assert rc == 1 and f"FAILED at their place in the series: {names[1]}\n" in text
    assert most[0] == 2


def test_places_with_kernel_tests_start_first(series, monkeypatch):
    """The interpreter makes a place with kernel tests the longest; started in
    series order, 0027's and 0028's ran alone at the end of CI's run."""
    started, lock = [], threading.Lock()
    # Both workers hold their place until the other has started one: the first
    # two started are the first two the pool was given.
    both = threading.Barrier(2, timeout=30)

    def at_its_place(series_, n, tests, extra, out):
        with lock:
            started.append(n)
        both.wait()
        return 0

    monkeypatch.setattr(prefix, "_at_its_place", at_its_place)
    only = ["0001", "0002", "0016", "0017"]
    kernel_places = {
        n
        for n, p in enumerate(series.patches, 1)
        if any(k in p.name for k in only)
        and any(t.startswith("tests/kernels/") for t in p.listed("Tests"))
    }
    assert len(kernel_places) == 2  # 0016's and 0017's
    rc = prefix.run(series, only, [], log=lambda *a, **k: None, jobs=2)
    assert rc == 0
    assert set(started[:2]) == kernel_places, started
    assert len(started) == 4


def test_a_patch_that_matches_nothing_is_named_not_passed(series, monkeypatch):
    """`hybridkv prefix-test 9999` ran nothing and printed that every patch's
    tests pass."""

    def at_its_place(*args):
        raise AssertionError("no patch should run")

    monkeypatch.setattr(prefix, "_at_its_place", at_its_place)
    printed = []
    with pytest.raises(SystemExit, match=r"matches '9999':.*e\.g\. its number"):
        prefix.run(series, ["0001", "9999"], [], log=printed.append)
    assert printed == []


def test_the_fork_server_loads_neither_vllm_nor_triton():
    """A place's tests import their own vllm, and kernel tests need the
    Triton interpreter chosen before triton loads: the server's preload
    must import neither (torch._dynamo, for one, imports triton)."""
    code = (
        "import sys\n"
        f"for name in {prefix.FORK_SERVER_PRELOAD!r}:\n"
        "    __import__(name)\n"
        "print(sorted({'vllm', 'triton'} & {m.split('.')[0] for m in sys.modules}))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


PLACE_TESTS = """
import sys
import types

import vllm


def test_sees_the_place_s_vllm():
    assert vllm.__file__.startswith({tree!r})


def test_red():
    assert False, "red at its place"


def test_swaps_vllm():
    if {swap!r}:
        sys.modules["vllm"] = types.SimpleNamespace(__file__="/elsewhere/vllm.py")
"""


@pytest.mark.parametrize("swap", [False, True])
def test_a_place_s_tests_run_forked_against_its_own_vllm(
    tmp_path, pristine_root, series, swap
):
    """Each place's pytest is a fork of a server that imported the heavy
    third-party modules once: its tests import the place's vllm, its status
    and output come back with its processor time, and a run that ended with
    another vllm loaded is refused (status 3), not passed."""
    tree = prefix_tree(series, 1, tmp_path / "tree")
    test_file = tmp_path / "test_place.py"
    test_file.write_text(PLACE_TESTS.format(tree=str(tree), swap=swap))
    before = prefix._cpu_seconds[0]
    with open(tmp_path / "out", "w+") as out:
        rc = prefix._pytest(tree, [str(test_file)], [], False, out)
        out.seek(0)
        text = out.read()
    assert "1 failed, 2 passed" in text, text
    assert "red at its place" in text
    assert "(cpu: " in text
    assert prefix._cpu_seconds[0] > before  # the run's total, for its last line
    if swap:
        assert rc == 3 and "imported vllm from /elsewhere/vllm.py" in text, text
    else:
        assert rc == 1, text
