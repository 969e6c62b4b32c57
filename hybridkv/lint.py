"""Lint the series as vLLM's CI would lint its pull requests.

ruff (the version vLLM 0.20.2 pins in .pre-commit-config.yaml) with vLLM
0.20.2's own configuration (the sdist's pyproject.toml): ``ruff check`` and
``ruff format`` over every overlay module and every test file the patches
ship, and, for the upstream files the series hooks, over the lines the series
adds (a hooked file is judged on our lines, not on upstream's). The
repository's own Python outside the series (tiny model builders, hybridkv's
tests, benchmarks, the lm-eval harness) is held to the same configuration.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from hybridkv.base import pristine_wheel_dir, upstream_tests_dir
from hybridkv.patchfile import apply_hunks, join_lines, read_lines
from hybridkv.series import Series

RUFF_VERSION = "0.14.0"  # vLLM 0.20.2's .pre-commit-config.yaml

# Not shipped by any patch, but run by CI and read by reviewers next to the
# series, so they follow the style the patches do.
REPO_DIRS = (
    "tests",  # what no patch lists: the repo's own tests (tools, benchmarks, docker)
    "benchmarks",
    ".buildkite/lm-eval-harness",
)


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        raise SystemExit(
            f"ruff is not installed; pip install ruff=={RUFF_VERSION} "
            "(requirements/cpu-test.txt has it)"
        )
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
    if version[-1:] != [RUFF_VERSION]:
        raise SystemExit(
            f"{exe} is ruff {' '.join(version[1:])}; vLLM 0.20.2 lints with ruff "
            f"{RUFF_VERSION}: pip install ruff=={RUFF_VERSION}"
        )
    return [exe]


def _config() -> Path:
    config = upstream_tests_dir() / "pyproject.toml"
    if not config.exists():
        raise SystemExit(f"{config} is missing; run `hybridkv fetch`")
    return config


def _patched(series: Series, path: str) -> tuple[list[str], set[int]]:
    """``path`` with the whole series applied, and the line numbers the series added."""
    upstream = read_lines(pristine_wheel_dir() / path)
    lines = upstream
    for p in series.patches:
        for d in p.diffs:
            if d.path == path:
                new = apply_hunks(lines, d.hunks)
                if new is None:
                    raise SystemExit(f"{p.name}: does not apply to {path}; run `hybridkv check`")
                lines = new
    ours: set[int] = set()
    matcher = difflib.SequenceMatcher(a=upstream, b=lines, autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            ours.update(range(j1 + 1, j2 + 1))
    return lines, ours


def _config_args(config: Path, root: Path) -> list[str]:
    # In vLLM's checkout ruff finds the first-party packages (vllm, tests)
    # beside the config; here the config lives elsewhere, so name them.
    return ["--config", str(config), "--config",
            "lint.isort.known-first-party = ['vllm', 'tests']"]


def _check(ruff: list[str], config: Path, files: list[Path], cwd: Path) -> list[dict]:
    out = subprocess.run(
        [*ruff, "check", *_config_args(config, cwd), "--output-format", "json", "--no-cache",
         *map(str, files)],
        capture_output=True, text=True, cwd=cwd,
    )
    return json.loads(out.stdout or "[]")


def _format_diff(ruff: list[str], config: Path, files: list[Path], cwd: Path) -> str:
    out = subprocess.run(
        [*ruff, "format", *_config_args(config, cwd), "--diff", "--no-cache", *map(str, files)],
        capture_output=True, text=True, cwd=cwd,
    )
    return out.stdout


def _hunks_by_file(diff: str) -> dict[str, list[tuple[int, int]]]:
    """{file: [(first, last) old line ranges that ruff format would change]}."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("--- "):
            current = line[4:].strip()
        elif (m := re.match(r"^@@ -(\d+)(?:,(\d+))?", line)) and current:
            start, count = int(m.group(1)), int(m.group(2) or 1)
            ranges.setdefault(current, []).append((start, start + max(count, 1) - 1))
    return ranges


def lint(series: Series, log=print) -> int:
    ruff, config = _ruff(), _config()
    problems: list[str] = []
    own = [series.repo / f for p in series.patches for f in p.listed("Overlay") + p.listed("Tests")]
    own = [f for f in own if f.suffix == ".py"]
    repo_files = sorted(
        {f for d in REPO_DIRS for f in (series.repo / d).rglob("*.py")
         if "__pycache__" not in f.parts} - set(own)
    )
    for d in _check(ruff, config, own + repo_files, series.repo):
        rel = Path(d["filename"]).relative_to(series.repo)
        loc = d["location"]
        problems.append(f"{rel}:{loc['row']}:{loc['column']}: {d['code']} {d['message']}")
    for name in _hunks_by_file(_format_diff(ruff, config, own + repo_files, series.repo)):
        problems.append(f"{name}: not `ruff format`-clean (run ruff format --config {config})")
    with tempfile.TemporaryDirectory(prefix="hybridkv-lint-") as tmp:
        hooked: dict[Path, set[int]] = {}
        for path in series.hooked_files():
            if not path.endswith(".py"):
                continue
            lines, ours = _patched(series, path)
            f = Path(tmp) / path
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(join_lines(lines))
            hooked[f] = ours
        files = list(hooked)
        base = Path(tmp) / "pristine"
        for f in files:
            rel = f.relative_to(tmp)
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pristine_wheel_dir() / rel, base / rel)
        # Upstream's own findings stay upstream's; a new one anywhere in the file
        # (an import our change left unused) or any on our lines is ours.
        upstream = Counter(
            (str(Path(d["filename"]).relative_to(base)), d["code"], d["message"])
            for d in _check(ruff, config, [base / f.relative_to(tmp) for f in files], base)
        )
        for d in _check(ruff, config, files, Path(tmp)):
            f = Path(d["filename"])
            rel = f.relative_to(tmp)
            row = d["location"]["row"]
            end = d.get("end_location", {}).get("row", row)
            key = (str(rel), d["code"], d["message"])
            if hooked[f] & set(range(row, end + 1)):
                problems.append(f"{rel}:{row}: {d['code']} {d['message']} (a line the series adds)")
            elif upstream[key] > 0:
                upstream[key] -= 1
            else:
                problems.append(f"{rel}:{row}: {d['code']} {d['message']} (new with the series)")
        for name, ranges in _hunks_by_file(_format_diff(ruff, config, files, Path(tmp))).items():
            f = Path(tmp) / name if not Path(name).is_absolute() else Path(name)
            ours = hooked.get(f, set())
            touched = [r for r in ranges if ours & set(range(r[0], r[1] + 1))]
            if touched:
                rel = f.relative_to(tmp)
                where = ", ".join(f"{a}-{b}" for a, b in touched)
                problems.append(f"{rel}: lines {where} (the series' lines) are not "
                                "`ruff format`-clean")
    for p in problems:
        log(f"LINT  {p}")
    if problems:
        log(f"FAILED LINT: {len(problems)} problems (ruff {RUFF_VERSION}, vLLM 0.20.2's config)")
        return 1
    log(f"Lint clean: {len(own)} overlay and test files, {len(repo_files)} repo-level "
        f"files, {len(hooked)} hooked files "
        f"(ruff {RUFF_VERSION}, vLLM 0.20.2's config)")
    return 0
