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

MANIFEST = "vllm/_hybridkv_manifest.json"

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
            res.fail("partially-applied", "some files of this patch are patched, others are not")
            continue
        contents.update(new_contents)
        changed.update(new_contents)
    overlay = _plan_overlay(root, series, results)
    pl = Plan(root, version, results, {p: contents[p] for p in changed}, overlay)
    pl.problems = _check_installed_state(pl, series, base)
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


def _plan_overlay(root: Path, series: Series, results: list[PatchResult]) -> dict[str, bytes]:
    ours = set()
    m = root / MANIFEST
    if m.exists():
        ours = set(json.loads(m.read_text()).get("overlay", []))
    overlay = {}
    for res in results:
        applied = res.status in ("ALREADY-APPLIED", "UPSTREAMED")
        for rel in res.patch.listed("Overlay"):
            data = (series.repo / rel).read_bytes()
            target = root / rel
            if applied and not target.exists():
                # Its hooks are in place and import this module.
                res.fail("overlay-missing", f"{rel}: not in {root}; run `hybridkv apply` again")
            elif applied and target.read_bytes() != data:
                res.fail("overlay-modified",
                         f"{rel}: sha256 {hashlib.sha256(target.read_bytes()).hexdigest()}, "
                         f"the series ships {hashlib.sha256(data).hexdigest()}")
            elif target.exists() and rel not in ours and target.read_bytes() != data:
                res.fail("overlay-shadows-upstream",
                         f"{rel}: vLLM already has this file; an overlay must be a new file")
            overlay[rel] = data
    return overlay


def _check_installed_state(pl: Plan, series: Series, base: Base) -> list[str]:
    """Overlay files and manifest of a tree the series was applied to."""
    m = pl.root / MANIFEST
    applied = [r for r in pl.results if r.status in ("ALREADY-APPLIED", "UPSTREAMED")]
    if not m.exists():
        if applied and len(applied) == len(pl.results):
            return [f"manifest-missing: {MANIFEST}: not in {pl.root}, though every patch "
                    "is applied (an interrupted apply?); run `hybridkv apply` again"]
        return []
    try:
        recorded = json.loads(m.read_text())
    except ValueError as e:
        return [f"manifest-unreadable: {MANIFEST}: {e}; run `hybridkv apply` again"]
    problems = []
    shipped = set(series.overlay_files())
    for rel in sorted(set(recorded.get("overlay", [])) - shipped):
        if (pl.root / rel).exists():
            problems.append(f"overlay-extra: {rel}: an earlier release's overlay file that "
                            "this series does not ship; reinstall vLLM from the new wheel")
    if len(applied) == len(pl.results) and recorded != manifest(series, base):
        problems.append(f"manifest-stale: {MANIFEST} does not describe this series "
                        f"(it says release {recorded.get('release')}, patches "
                        f"{[p.get('name') for p in recorded.get('patches', [])]}); "
                        "run `hybridkv apply` again")
    return problems


def manifest(series: Series, base: Base) -> dict:
    return {
        "base": base.version,
        "release": base.release,
        "version": base.label,
        "patches": [
            {
                "name": p.name,
                "subject": p.subject,
                "bug": p.fields.get("Bug", ""),
                "fixes": re.findall(r"^Fixes (.+)$", p.body, re.M),
            }
            for p in series.patches
        ],
        "overlay": sorted(series.overlay_files()),
    }


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


def report(pl: Plan, verbose: bool = False, out=print) -> int:
    for res in pl.results:
        reason = f"  ({', '.join(dict.fromkeys(res.reasons))})" if res.reasons else ""
        out(f"{res.status:<{STATUS_WIDTH}} {res.patch.name}{reason}")
        if res.status == "FAILED" or verbose:
            for d in res.details:
                out(f"{'':<{STATUS_WIDTH}}   {d}")
            if verbose:
                out(f"{'':<{STATUS_WIDTH}}   {res.patch.subject}")
    for problem in pl.problems:
        out(f"{'FAILED':<{STATUS_WIDTH}} {problem}")
    if pl.ok:
        out(f"Passed validation ({len(pl.results)} patches) on vLLM {pl.version} at {pl.root}")
        return 0
    out("FAILED VALIDATION; see above")
    return 1
