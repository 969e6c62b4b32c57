"""What a tree the series was applied to holds besides its hooks: the overlay
files and the manifest, checked, and which of their problems `apply` repairs.

An apply that was interrupted (killed between two files, a file deleted
afterwards) leaves hooks without the overlay modules they import, or a tree
without its manifest. Each hooked file is then still at some prefix of the
series (anything else is drift and is refused), so writing the series again
gives byte for byte what a fresh apply gives: those problems are repaired by
`apply`, not only reported. A file someone edited is never overwritten; its
problem names the command that puts the series' file back.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

from hybridkv.base import Base
from hybridkv.series import Series

MANIFEST = "vllm/_hybridkv_manifest.json"

# Reasons whose fix is to write the series again. A partially-applied patch
# qualifies because every one of its files is at a prefix of the series (or
# the file fails as drifted), so completing it is what a fresh apply writes.
REPAIRABLE = frozenset({
    "overlay-missing",
    "partially-applied",
    "manifest-missing",
    "manifest-stale",
    "manifest-unreadable",
})


def reason_of(problem: str) -> str:
    """The reason a tree-wide problem line starts with (``reason: ...``)."""
    return problem.split(":", 1)[0]


def read_manifest(root: Path) -> tuple[dict | None, str]:
    """The tree's manifest, and why it could not be read ("" when it could or is absent)."""
    m = root / MANIFEST
    if not m.exists():
        return None, ""
    try:
        recorded = json.loads(m.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return None, str(e)
    if not isinstance(recorded, dict):
        return None, f"holds a JSON {type(recorded).__name__}, not an object"
    return recorded, ""


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


def plan_overlay(root: Path, series: Series, results) -> dict[str, bytes]:
    """The overlay files to write; fails the results whose overlay is wrong."""
    recorded, _ = read_manifest(root)
    ours = set(_names((recorded or {}).get("overlay")))
    overlay = {}
    for res in results:
        applied = res.status in ("ALREADY-APPLIED", "UPSTREAMED")
        for rel in res.patch.listed("Overlay"):
            data = (series.repo / rel).read_bytes()
            target = root / rel
            if applied and not target.exists():
                # Its hooks are in place and import this module.
                res.fail("overlay-missing",
                         f"{rel}: not in {root}, though this patch's hooks are "
                         "(an interrupted apply?); apply writes it")
            elif applied and target.read_bytes() != data:
                res.fail("overlay-modified",
                         f"{rel}: sha256 {hashlib.sha256(target.read_bytes()).hexdigest()}, "
                         f"the series ships {hashlib.sha256(data).hexdigest()}; apply does "
                         "not overwrite an edited file. To put the series' file back: "
                         f"cp {shlex.quote(str(series.repo / rel))} {shlex.quote(str(target))}")
            elif target.exists() and rel not in ours and target.read_bytes() != data:
                res.fail("overlay-shadows-upstream",
                         f"{rel}: vLLM already has this file; an overlay must be a new file")
            overlay[rel] = data
    return overlay


def installed_state(root: Path, results, series: Series, base: Base) -> list[str]:
    """Tree-wide problems of the manifest and of overlay files no patch ships."""
    recorded, unreadable = read_manifest(root)
    every = all(r.status in ("ALREADY-APPLIED", "UPSTREAMED") for r in results)
    if unreadable:
        return [f"manifest-unreadable: {MANIFEST}: {unreadable}; apply writes it again"]
    if recorded is None:
        if every and results:
            return [f"manifest-missing: {MANIFEST}: not in {root}, though every patch "
                    "is applied (an interrupted apply?); apply writes it"]
        return []
    problems = []
    shipped = set(series.overlay_files())
    for rel in sorted(set(_names(recorded.get("overlay"))) - shipped):
        if (root / rel).exists():
            problems.append(f"overlay-extra: {rel}: an earlier release's overlay file that "
                            "this series does not ship; remove it "
                            f"(rm {shlex.quote(str(root / rel))}) or reinstall vLLM from the "
                            "new wheel")
    if every and recorded != manifest(series, base):
        problems.append(f"manifest-stale: {MANIFEST} does not describe this series "
                        f"(it says release {recorded.get('release')}, patches "
                        f"{_names(recorded.get('patches'))}), though every "
                        "hooked file matches it; apply writes it again")
    return problems


def _names(entries) -> list[str]:
    """The names in a manifest list (file names, or patch entries), whatever wrote it."""
    if not isinstance(entries, list):
        return []
    return [str(e.get("name") if isinstance(e, dict) else e) for e in entries]
