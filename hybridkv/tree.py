"""Check or apply the series to a vLLM tree: a pristine unpacked wheel, or an installed vLLM.

The tree must be the pinned base. Every file a patch touches must be, byte for
byte, either the published base file or that file with a prefix of the series
applied; anything else is drift and fails the run (we build wheels, so drift
must stop the build rather than be skipped at runtime).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.base import Base, load_base
from hybridkv.patchfile import Patch, apply_hunks, join_lines, locate, read_lines
from hybridkv.series import Series
from hybridkv.treestate import (
    MANIFEST,
    REPAIRABLE,
    installed_state,
    manifest,
    plan_overlay,
    reason_of,
)

STATUS_WIDTH = 16


class Refusal(SystemExit):
    """The tree is not a base this series was made for."""


@dataclass
class PatchResult:
    patch: Patch
    status: str = "APPLIED"
    reasons: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def fail(self, reason: str, *details: str) -> None:
        self.status = "FAILED"
        self.reasons.append(reason)
        self.details.extend(details)


@dataclass
class Plan:
    root: Path
    version: str
    results: list[PatchResult]
    files: dict[str, list[str]]  # path -> new content lines, for files that change
    overlay: dict[str, bytes]
    problems: list[str] = field(default_factory=list)
    """Tree-wide failures: stale overlay files, a missing or stale manifest."""

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.status != "FAILED" for r in self.results)

    @property
    def repairable(self) -> bool:
        """Not ok, and every failure is one that writing the series again repairs."""
        reasons = {why for r in self.results for why in r.reasons}
        reasons |= {reason_of(p) for p in self.problems}
        return not self.ok and reasons <= REPAIRABLE


def installed_root(search_path: list[str] | None = None) -> Path:
    """site-packages dir holding the installed vllm of this interpreter (not imported).

    Only directories that carry vLLM's dist-info count as an install: a
    ``vllm/`` folder in the working directory (this repository's overlay, or a
    source checkout) is not one, though ``import vllm`` there would find it.
    """
    for entry in sys.path if search_path is None else search_path:
        root = Path(entry or os.getcwd())
        if (root / "vllm" / "__init__.py").is_file() and dist_info(root) is not None:
            return root.resolve()
    raise Refusal(
        "no installed vllm found for this Python (a directory on sys.path holding "
        "vllm/ and vllm-*.dist-info); install vllm==0.20.2 first"
    )


def dist_info(root: Path) -> Path | None:
    for d in sorted(root.glob("vllm-*.dist-info")):
        if (d / "METADATA").exists():
            return d
    return None


def tree_version(root: Path) -> tuple[str, str]:
    """(version, where it was read) of the vLLM in ``root``."""
    d = dist_info(root)
    if d is not None:
        for line in (d / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), str(d / "METADATA")
    v = root / "vllm" / "_version.py"
    if v.exists():
        m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", v.read_text())
        if m:
            return m.group(1), str(v)
    raise Refusal(f"{root}: no vllm-*.dist-info/METADATA or vllm/_version.py; is this a vLLM tree?")


def check_version(root: Path, base: Base) -> str:
    version, where = tree_version(root)
    public = version.split("+", 1)[0]
    if public != base.version or ("+" in version and "+hybridkv." not in version):
        raise Refusal(
            f"hybridkv {base.label} is made for vLLM {base.version}, but {root} holds "
            f"vLLM {version} (read from {where}).\n"
            f"  Install the base first: pip install vllm=={base.version}\n"
            f"  or use a hybridkv release made for vLLM {public}."
        )
    return version


def pristine_hashes(series: Series) -> dict[str, str]:
    hashes = {}
    f = series.repo / "patches" / "pristine.sha256"
    if f.exists():
        for line in f.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                digest, path = line.split(None, 1)
                hashes[path.strip()] = digest
    return hashes


def _sha(lines: list[str]) -> str:
    return hashlib.sha256(join_lines(lines)).hexdigest()


def _applied_prefix(lines: list[str], path: str, patches: list[Patch], pristine: str) -> int | None:
    """How many of the series' patches are already in this file (None: drifted)."""
    touching = [i for i, p in enumerate(patches) if any(d.path == path for d in p.diffs)]
    for k in range(len(touching), -1, -1):
        cur: list[str] | None = lines
        for i in reversed(touching[:k]):
            for d in reversed(patches[i].diffs):
                if d.path == path and cur is not None:
                    cur = apply_hunks(cur, d.hunks, reverse=True)
        if cur is not None and _sha(cur) == pristine:
            return k
    return None


def plan(root: Path, series: Series, base: Base | None = None) -> Plan:
    base = base or load_base()
    version = check_version(root, base)
    hashes = pristine_hashes(series)
    results = [PatchResult(p) for p in series.patches]
    contents: dict[str, list[str]] = {}
    changed: set[str] = set()
    drifted: dict[str, str] = {}
    applied_in: dict[str, set[int]] = {}
    for path in series.hooked_files():
        f = root / path
        if not f.exists():
            continue
        contents[path] = read_lines(f)
        if path not in hashes:
            drifted[path] = "no pristine sha256 recorded in patches/pristine.sha256 (run `hybridkv refresh`)"
        elif (k := _applied_prefix(contents[path], path, series.patches, hashes[path])) is not None:
            # Later patches may rewrite an earlier patch's lines, so "already
            # applied" is decided for the series prefix, not patch by patch.
            touching = [i for i, p in enumerate(series.patches) if any(d.path == path for d in p.diffs)]
            applied_in[path] = set(touching[:k])
        else:
            drifted[path] = (
                f"sha256 {hashlib.sha256(f.read_bytes()).hexdigest()} is neither vLLM "
                f"{base.version}'s ({hashes[path]}) nor that file with hybridkv patches applied"
            )
    for index, res in enumerate(results):
        new_contents: dict[str, list[str]] = {}
        states = set()
        for d in res.patch.diffs:
            if d.path in drifted:
                res.fail("file-drifted", f"{d.path}: {drifted[d.path]}")
                continue
            if index in applied_in.get(d.path, ()):
                states.add("applied")
                continue
            if d.path not in contents:
                if d.is_new:
                    contents[d.path] = []
                else:
                    res.fail("file-missing", f"{d.path}: not in {root}")
                    continue
            lines = new_contents.get(d.path, contents[d.path])
            fwd = apply_hunks(lines, d.hunks)
            if fwd is not None:
                states.add("apply")
                new_contents[d.path] = fwd
            elif apply_hunks(lines, d.hunks, reverse=True) is not None:
                states.add("applied")
            else:
                res.fail(*_explain(lines, d.path, d.hunks))
        if res.status == "FAILED":
            continue
        if states == {"applied"}:
            res.status = "UPSTREAMED" if res.patch.fields.get("Applied-Upstream") else "ALREADY-APPLIED"
        elif "applied" in states:
            # Kept in the plan: completing the files not yet patched is what
            # a fresh apply writes there (see hybridkv.treestate).
            paths = list(dict.fromkeys(d.path for d in res.patch.diffs))
            res.fail("partially-applied",
                     *(f"{p}: patched" for p in paths if p not in new_contents),
                     *(f"{p}: not patched (apply patches it)"
                       for p in paths if p in new_contents))
        contents.update(new_contents)
        changed.update(new_contents)
    overlay = plan_overlay(root, series, results)
    pl = Plan(root, version, results, {p: contents[p] for p in changed}, overlay)
    pl.problems = installed_state(root, results, series, base)
    return pl


def _explain(lines: list[str], path: str, hunks) -> tuple[str, ...]:
    offset = 0
    for n, h in enumerate(hunks, 1):
        r = locate(lines, h, offset)
        if r.status == "failed":
            return (r.reason, f"{path} hunk {n} (@@ -{h.old_start}):", *("  " + d for d in r.detail))
        if r.status == "apply":
            lines = lines[:r.at] + h.new + lines[r.at + len(h.old):]
            offset += len(h.new) - len(h.old)
    return ("context-mismatch", f"{path}: hunks apply only partly")


def rendered_files(pl: Plan, series: Series, base: Base) -> dict[str, bytes]:
    """Every file the series writes into the tree, as bytes."""
    out = {p: join_lines(lines) for p, lines in pl.files.items()}
    out.update(pl.overlay)
    out[MANIFEST] = (json.dumps(manifest(series, base), indent=2) + "\n").encode()
    return out


class ApplyError(SystemExit):
    """A write failed; the tree was restored as it was."""


def _stage(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _commit(staged: Path, target: Path) -> None:
    os.replace(staged, target)


def write(pl: Plan, series: Series, base: Base) -> None:
    """Write every file of the series, or none: stage each beside its target,
    then move them into place; on any failure, put back what was there."""
    files = rendered_files(pl, series, base)
    record = _updated_record(pl.root, files)
    if record is not None:
        files[record[0]] = record[1]
    made_dirs: list[Path] = []
    staged: dict[str, Path] = {}
    kept: dict[str, Path] = {}
    done: list[str] = []
    try:
        for rel, data in files.items():
            target = pl.root / rel
            missing = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
            for d in reversed(missing):
                d.mkdir()
                made_dirs.append(d)
            staged[rel] = target.with_name(f".{target.name}.hybridkv-new")
            _stage(staged[rel], data)
        for rel in files:
            target = pl.root / rel
            if target.exists():
                kept[rel] = target.with_name(f".{target.name}.hybridkv-old")
                shutil.copy2(target, kept[rel])
            _commit(staged[rel], target)
            del staged[rel]
            done.append(rel)
    except OSError as e:
        for rel in reversed(done):
            target = pl.root / rel
            if rel in kept:
                os.replace(kept.pop(rel), target)
            else:
                target.unlink()
        for path in [*staged.values(), *kept.values()]:
            path.unlink(missing_ok=True)
        for d in reversed(made_dirs):
            d.rmdir()
        raise ApplyError(
            f"apply failed writing into {pl.root}: {e}. Nothing was changed; fix the "
            "cause (permissions, disk space) and run it again."
        ) from e
    for path in kept.values():
        path.unlink()


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _updated_record(root: Path, files: dict[str, bytes]) -> tuple[str, bytes] | None:
    # Keep pip's RECORD true, so `pip uninstall vllm` also removes our overlay files.
    d = dist_info(root)
    if d is None or not (d / "RECORD").exists():
        return None
    rows = list(csv.reader(io.StringIO((d / "RECORD").read_text())))
    index = {r[0]: i for i, r in enumerate(rows) if r}
    for rel, data in files.items():
        row = [rel, record_hash(data), str(len(data))]
        if rel in index:
            rows[index[rel]] = row
        else:
            rows.append(row)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return str((d / "RECORD").relative_to(root)), buf.getvalue().encode()


def report(pl: Plan, verbose: bool = False, out=print, fix: str = "hybridkv apply",
           repaired: bool = False) -> int:
    """One line per patch and per tree-wide problem, then the verdict.

    ``fix`` is the command that repairs what is repairable (the apply of this
    same tree); ``repaired``: that apply has just written the series, so the
    repairable failures are shown as REPAIRED and the tree passes.
    """
    for res in pl.results:
        reason = f"  ({', '.join(dict.fromkeys(res.reasons))})" if res.reasons else ""
        status = "REPAIRED" if repaired and res.status == "FAILED" else res.status
        out(f"{status:<{STATUS_WIDTH}} {res.patch.name}{reason}")
        if res.status == "FAILED" or verbose:
            for d in res.details:
                out(f"{'':<{STATUS_WIDTH}}   {d}")
            if verbose:
                out(f"{'':<{STATUS_WIDTH}}   {res.patch.subject}")
    for problem in pl.problems:
        out(f"{'REPAIRED' if repaired else 'FAILED':<{STATUS_WIDTH}} {problem}")
    if pl.ok or repaired:
        out(f"Passed validation ({len(pl.results)} patches) on vLLM {pl.version} at {pl.root}")
        return 0
    if pl.repairable:
        out(f"To repair: {fix}")
    elif any(reason_of(p) in REPAIRABLE for p in pl.problems) or any(
            set(r.reasons) & REPAIRABLE for r in pl.results):
        out(f"After the fixes named above, `{fix}` repairs the rest.")
    out("FAILED VALIDATION; see above")
    return 1
