"""Every patch at its own place: patches 1..N on pristine vLLM, patch N's tests there.

That is what a reviewer of patch N's pull request and a rebase see: a patch
whose tests pass only with later patches applied does not stand alone. For
each N the tree is a link farm of the pristine wheel with the files patches
1..N write as real files: a directory no patch writes into is one link, the
directories above a written file are made and their other entries linked, so
building one costs a tenth of a second, not a copy of the wheel.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridkv.base import REPO, pristine_wheel_dir
from hybridkv.patchfile import apply_hunks, join_lines, read_lines
from hybridkv.series import Series

# Triton kernel tests need the interpreter chosen before triton is imported.
INTERPRETED = ("tests/kernels/",)


def _interpreted(test: str) -> bool:
    return test.startswith(INTERPRETED)


def prefix_tree(series: Series, n: int, dest: Path) -> Path:
    """Pristine vLLM with the first ``n`` patches of ``series`` applied, at ``dest``."""
    src = pristine_wheel_dir()
    written = [Path(d.path) for p in series.patches[:n] for d in p.diffs]
    written += [Path(rel) for p in series.patches[:n] for rel in p.listed("Overlay")]
    made = {parent for path in written for parent in path.parents}
    dest.mkdir(parents=True, exist_ok=True)
    _link_farm(src, dest, Path("vllm"), made)
    for info in src.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    for patch in series.patches[:n]:
        for d in patch.diffs:
            f = dest / d.path
            new = apply_hunks(read_lines(f) if f.exists() else [], d.hunks)
            if new is None:
                raise SystemExit(f"{patch.name}: does not apply at its place ({d.path})")
            if f.is_symlink():
                f.unlink()
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(join_lines(new))
        for rel in patch.listed("Overlay"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(series.repo / rel, dest / rel)
    return dest


def _link_farm(src: Path, dest: Path, rel: Path, made: set[Path]) -> None:
    """``src / rel`` at ``dest / rel``: one link where no patch writes below it,
    else a directory of its own whose entries are linked the same way."""
    if rel not in made:
        os.symlink(src / rel, dest / rel)
        return
    (dest / rel).mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(src / rel):
        if entry.name == "__pycache__":
            continue
        if entry.is_dir(follow_symlinks=False):
            _link_farm(src, dest, rel / entry.name, made)
        else:
            os.symlink(entry.path, dest / rel / entry.name)


# Third-party modules every place's tests import the same way. A fork server
# imports them once and each place's pytest starts as a fork of it: a place's
# process then takes ~8 s of processor time instead of ~11 (measured on CI's kind
# of 2-core box), about 40 processes a run. Not vllm, which each place has its
# own of, and nothing that imports triton: the Triton interpreter must be chosen
# before triton loads (torch._dynamo and transformers' image processors import it).
# The second line is what vllm.config and the KV-cache planner import besides,
# triton-free: 3.4 -> 1.9 s of a place's vllm imports.
FORK_SERVER_PRELOAD = ["numpy", "torch", "transformers", "gguf", "pytest",
                       "openai", "scipy.signal", "scipy.stats", "setuptools",
                       "torch.fx.experimental.symbolic_shapes",
                       "torch.utils.cpp_extension"]
_fork_server: list = []
# Processor seconds of the places' pytest runs, summed for the run's last line.
_cpu_seconds = [0.0]
_cpu_lock = threading.Lock()


def _forked_pytest_context():
    if not _fork_server:
        # huggingface_hub reads it when the server imports transformers.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
        _fork_server.append(ctx)
    return _fork_server[0]


def _place_env(tree: Path, interpret: bool) -> dict[str, str]:
    env = {
        # The prefix tree first: it shadows the installed vllm; the repo after it
        # for tests.models and hybridkv.
        "PYTHONPATH": os.pathsep.join(
            [str(tree), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        # Bytecode of modules in linked directories would otherwise be written
        # into the pristine wheel's own tree.
        "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    if interpret:
        env["HYBRIDKV_TRITON_INTERPRET"] = "1"
    return env


def _pytest_at_place(tree: str, args: list[str], env: dict[str, str],
                     out_path: str | None, cpu_path: str) -> None:
    """A fork server's child: pytest ``args`` against the prefix ``tree``, as
    ``python -m pytest`` run with ``env`` would; exits with pytest's status."""
    if out_path is not None:
        with open(out_path, "ab", buffering=0) as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
    if "vllm" in sys.modules:
        print("hybridkv prefix-test: vllm was imported before the place's tree was "
              "on the path, so these tests would not see this place's patches: "
              "take the module that imports it out of FORK_SERVER_PRELOAD",
              flush=True)
        os._exit(3)
    os.environ.update(env)
    sys.path[0:0] = env["PYTHONPATH"].split(os.pathsep)
    sys.dont_write_bytecode = True
    os.chdir(REPO)
    import pytest

    rc = int(pytest.main(args))
    where = getattr(sys.modules.get("vllm"), "__file__", None) or tree
    # Not resolved: the place's pristine files are links into the pristine wheel.
    if not Path(os.path.abspath(where)).is_relative_to(os.path.abspath(tree)):
        print(f"hybridkv prefix-test: the tests imported vllm from {where}, not from "
              f"this place's tree {tree}", flush=True)
        rc = 3
    # This process's own processor time (its children's included): CI's two cores
    # make the lane's length the sum of these.
    cpu = [resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                              resource.RUSAGE_CHILDREN)]
    user, system = (sum(u.ru_utime for u in cpu), sum(u.ru_stime for u in cpu))
    print(f"   (cpu: {user:.1f} s user, {system:.1f} s system)", flush=True)
    # The fork server, not this run's process, is its parent: the run's total
    # comes back through this file.
    Path(cpu_path).write_text(f"{user + system}")
    os._exit(rc)


def _pytest(tree: Path, tests: list[str], extra: list[str], interpret: bool, out) -> int:
    """Run ``tests`` against ``tree``; its output goes to ``out`` (None: this
    process's stdout and stderr)."""
    # Hypothesis's pytest plugin costs 0.8 s of imports a process, ~40 processes a
    # run; its @given tests run without it.
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
            "-p", "hybridkv.testing.pytest_plugin", *tests, *extra]
    print(f"   $ -m pytest {' '.join(args)}" + ("  (Triton interpreter)" if interpret
                                               else ""),
          file=out or sys.stdout, flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridkv-prefix-out-") as tmp:
        out_path = None if out is None else os.path.join(tmp, "out")
        cpu_path = os.path.join(tmp, "cpu")
        proc = _forked_pytest_context().Process(
            target=_pytest_at_place,
            args=(str(tree), args, _place_env(tree, interpret), out_path, cpu_path),
        )
        proc.start()
        proc.join()
        if out_path is not None:
            with open(out_path, errors="replace") as f:
                out.write(f.read())
            out.flush()
        if os.path.exists(cpu_path):
            with _cpu_lock:
                _cpu_seconds[0] += float(Path(cpu_path).read_text())
    return proc.exitcode


def _at_its_place(series: Series, n: int, tests: list[str], extra: list[str],
                  out) -> int:
    """Patch ``n``'s ``tests`` on pristine vLLM with patches 1..n; its return code."""
    with tempfile.TemporaryDirectory(prefix=f"hybridkv-prefix-{n:02d}-") as tmp:
        tree = prefix_tree(series, n, Path(tmp))
        plain = [t for t in tests if not _interpreted(t)]
        kernels = [t for t in tests if _interpreted(t)]
        rc = 0
        for group, interpret in ((plain, False), (kernels, True)):
            if group:
                rc |= _pytest(tree, group, extra, interpret, out)
    return rc


def run(series: Series, only: list[str], extra: list[str], skip_full: bool = False,
        log=print, jobs: int = 1) -> int:
    """Run each selected patch's tests at its place; 0 if all pass.

    ``skip_full`` leaves out the last patch, whose place is the whole series
    (CI tests that already, against the installed wheel). With ``jobs`` > 1
    that many patches run at once (each in its own tree and process); each
    one's output is held and printed in series order.
    """
    chosen = {k: {p.name for p in series.patches if k in p.name} for k in only}
    unmatched = [k for k, names in chosen.items() if not names]
    if unmatched:
        # Otherwise the run selects nothing and reports every patch passing.
        raise SystemExit(
            f"no patch in patches/series matches {', '.join(map(repr, unmatched))}: "
            "give part of a patch's name, e.g. its number (0017); known: "
            + ", ".join(p.name for p in series.patches)
        )
    names = set().union(*chosen.values())
    selected = []
    for n, patch in enumerate(series.patches, 1):
        if only and patch.name not in names:
            continue
        if skip_full and n == len(series.patches):
            selected.append((n, patch, None))
            continue
        tests = [t for t in patch.listed("Tests") if Path(t).name.startswith("test_")]
        selected.append((n, patch, tests))

    def heading(n, patch, tests):
        if tests is None:
            return f"\n== {patch.name}: the whole series; its tests ran against the wheel"
        return (f"\n== {patch.name}: patches 1..{n} on pristine vLLM, "
                f"its {len(tests)} test files")

    def held(n, tests):
        with tempfile.TemporaryFile("w+") as out:
            rc = _at_its_place(series, n, tests, extra, out)
            out.seek(0)
            return rc, out.read()

    # Places with kernel tests start first: the interpreter makes them the longest,
    # and one of them started last would run alone at the end of the run. Through
    # the interpreter memo the order only moves which of CI's two kernel runs makes
    # a launch and which reads it back (711 and 715 launches made in all, in two
    # rehearsals, one each way); started last they made CI no shorter (898 s).
    def interpreted_first(entry):
        n, _, tests = entry
        return (not any(map(_interpreted, tests)), n)

    failed = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending = {
            n: pool.submit(held, n, tests)
            for n, _, tests in sorted(
                (e for e in selected if e[2] and jobs > 1), key=interpreted_first
            )
        }
        for n, patch, tests in selected:
            log(heading(n, patch, tests), flush=True)
            if not tests:
                continue
            if n in pending:
                rc, text = pending[n].result()
                log(text, end="", flush=True)
            else:
                rc = _at_its_place(series, n, tests, extra, None)
            if rc:
                failed.append(patch.name)
    if failed:
        log(f"\nFAILED at their place in the series: {', '.join(failed)}")
        return 1
    log("\nEvery patch's tests pass with only the patches up to it applied "
        f"({_cpu_seconds[0]:.0f} s of processor time in their pytest runs).")
    return 0
