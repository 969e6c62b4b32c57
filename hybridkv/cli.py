"""hybridkv: apply, check, build and export the patch series on vLLM.

    hybridkv fetch                  download + verify pristine vLLM (wheel, sdist tests)
    hybridkv check [--tree D|--installed] [-v]
    hybridkv apply [--tree D|--installed]
    hybridkv wheel [--out DIR]      build dist/vllm-X.Y.Z+hybridkv.N-*.whl
    hybridkv export PATCH [--out DIR]
    hybridkv dev [DIR] / hybridkv refresh [DIR]
    hybridkv report                 what the installed vLLM is, and which patches it carries
    hybridkv prefix-test [PATCH...] [--jobs N] [-- PYTEST-ARGS]   each patch's tests with patches 1..N only
    hybridkv lint                   ruff (vLLM 0.20.2's config) over overlay, tests, added lines
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from importlib import metadata
from pathlib import Path

from hybridkv import base as base_mod
from hybridkv.checkout import follow_current_checkout
from hybridkv.fetch import fetch, unpack
from hybridkv.patchfile import PatchFormatError
from hybridkv.series import load_series, static_problems

DEFAULT_DEV = base_mod.cache_dir() / "dev"


def _ensure_pristine() -> dict[str, Path]:
    files = fetch()
    unpack(files)
    return files


def _target(args) -> Path:
    from hybridkv.tree import installed_root

    if args.installed:
        return installed_root()
    if args.tree:
        return Path(args.tree).resolve()
    _ensure_pristine()
    return base_mod.pristine_wheel_dir()


def _static_ok() -> bool:
    problems = static_problems()
    for p in problems:
        print(f"FAILED           {p}")
    return not problems


def cmd_fetch(args) -> int:
    _ensure_pristine()
    return 0


def cmd_check(args, write: bool = False) -> int:
    from hybridkv import tree

    if not _static_ok():
        print("FAILED VALIDATION; see above")
        return 1
    series = load_series()
    root = _target(args)
    pl = tree.plan(root, series)
    fix = _apply_command(args)
    if not (write and (pl.ok or pl.repairable)):
        return tree.report(pl, verbose=args.verbose, fix=fix)
    # What an interrupted apply left is repaired by writing the series again
    # (hybridkv.treestate says why that is safe); the report follows the write.
    tree.write(pl, series, base_mod.load_base())
    rc = tree.report(pl, verbose=args.verbose, fix=fix, repaired=not pl.ok)
    print(f"wrote {len(pl.files)} patched files, {len(pl.overlay)} overlay files "
          f"and {tree.MANIFEST} into {root}")
    return rc


def _apply_command(args) -> str:
    """The `apply` of the tree this command looked at, as the user would type it."""
    if args.installed:
        return "hybridkv apply --installed"
    if args.tree:
        return f"hybridkv apply --tree {shlex.quote(str(Path(args.tree).resolve()))}"
    return "hybridkv apply"


def cmd_wheel(args) -> int:
    from hybridkv.wheel import build

    if not _static_ok():
        return 1
    files = _ensure_pristine()
    build(files["wheel"], load_series(), Path(args.out))
    return 0


def cmd_export(args) -> int:
    from hybridkv.export import export

    _ensure_pristine()
    series = load_series()
    patches = series.patches if args.patch == "all" else [series.by_name(args.patch)]
    for p in patches:
        export(p, series, Path(args.out))
    return 0


def cmd_dev(args) -> int:
    from hybridkv.devtree import dev

    _ensure_pristine()
    dev(load_series(), Path(args.dir))
    return 0


def cmd_refresh(args) -> int:
    from hybridkv.devtree import refresh

    _ensure_pristine()
    refresh(Path(args.dir))
    return 0 if _static_ok() else 1


def _positive(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least 1, found {text!r} (e.g. 2)")
    return value


def cmd_prefix_test(args) -> int:
    from hybridkv.prefix import run

    _ensure_pristine()
    return run(load_series(), args.patches, args.pytest_args, skip_full=args.skip_full,
               jobs=args.jobs)


def cmd_lint(args) -> int:
    from hybridkv.lint import lint

    _ensure_pristine()
    return lint(load_series())


def cmd_report(args) -> int:
    b = base_mod.load_base()
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        print("vLLM is not installed in this environment.")
        return 1
    from hybridkv.tree import MANIFEST, installed_root

    root = installed_root()
    print(f"vLLM {version} at {root / 'vllm'}")
    m = root / MANIFEST
    if not m.exists():
        print(f"This is not a hybridkv build (no {MANIFEST}); expected {b.label}.")
        return 1
    man = json.loads(m.read_text())
    print(f"hybridkv release {man['release']} on vLLM {man['base']}: {len(man['patches'])} patches")
    for p in man["patches"]:
        fixes = ", ".join(p["fixes"]) or "-"
        print(f"  {p['name']}\n      {p['subject']}\n      fixes: {fixes}")
    return 0 if version == man["version"] else 1


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # Run as a program (the console script, `python -m hybridkv`): work on
        # the checkout the current directory is in (hybridkv.checkout says why).
        try:
            follow_current_checkout(sys.argv[1:])
        except SystemExit as e:
            print(f"hybridkv: {e.code}", file=sys.stderr)
            return 2
    ap = argparse.ArgumentParser(prog="hybridkv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and verify pristine vLLM").set_defaults(func=cmd_fetch)
    for name, func in (("check", cmd_check), ("apply", lambda a: cmd_check(a, write=True))):
        p = sub.add_parser(name, help=f"{name} the series against a vLLM tree")
        g = p.add_mutually_exclusive_group()
        g.add_argument("--tree", help="a directory holding vllm/ (default: the pristine wheel)")
        g.add_argument("--installed", action="store_true", help="this Python's installed vllm")
        p.add_argument("-v", "--verbose", action="store_true")
        p.set_defaults(func=func)
    p = sub.add_parser("wheel", help="build the patched wheel")
    p.add_argument("--out", default=str(base_mod.REPO / "dist"))
    p.set_defaults(func=cmd_wheel)
    p = sub.add_parser("export", help="export a patch as an upstream PR diff + description")
    p.add_argument("patch", help="patch name, file name, number (0001) or 'all'")
    p.add_argument("--out", default=str(base_mod.REPO / "dist" / "export"))
    p.set_defaults(func=cmd_export)
    for name, func in (("dev", cmd_dev), ("refresh", cmd_refresh)):
        p = sub.add_parser(name, help=f"{name} the git working tree of the series")
        p.add_argument("dir", nargs="?", default=str(DEFAULT_DEV))
        p.set_defaults(func=func)
    sub.add_parser("report", help="report the installed vLLM and its patches").set_defaults(
        func=cmd_report)
    p = sub.add_parser("prefix-test",
                       help="run each patch's tests on pristine vLLM with patches 1..N applied")
    p.add_argument("patches", nargs="*", help="only these patches (name, file or number)")
    p.add_argument("--skip-full", action="store_true",
                   help="leave out the last patch (its place is the whole series)")
    p.add_argument("--jobs", type=_positive, default=1, metavar="N",
                   help="patches run at once (each in its own process; output held "
                   "and printed in series order); default 1")
    p.set_defaults(func=cmd_prefix_test, pytest_args=[])
    sub.add_parser("lint", help="ruff check + format, vLLM 0.20.2's config").set_defaults(
        func=cmd_lint)
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        argv, pytest_args = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    args = ap.parse_args(argv)
    if pytest_args:
        args.pytest_args = pytest_args
    try:
        return args.func(args)
    except PatchFormatError as e:
        # A damaged patch fails the series' validation, as it does in `check`.
        print(f"hybridkv: {e}\nFAILED VALIDATION; `hybridkv check` lists every problem",
              file=sys.stderr)
        return 1
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"hybridkv: {e.code}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
