"""The ordered patch series and the static checks every patch must pass.

A patch owns three kinds of files: its hooks (the diff against upstream files),
its overlay (new files under vllm/, listed in its ``Overlay:`` field) and its
tests (``Tests:``). Export and the dev tree use that ownership; the checks keep
it total (every overlay file has exactly one owner).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridkv.base import REPO, load_base
from hybridkv.patchfile import REQUIRED_FIELDS, Patch, PatchFormatError, parse

OVERLAY_ROOTS = ("vllm",)


@dataclass
class Series:
    patches: list[Patch]
    repo: Path = REPO

    def by_name(self, name: str) -> Patch:
        for p in self.patches:
            if name in (p.name, Path(p.name).name, Path(p.name).stem):
                return p
            # Allow the number alone: "0001".
            if Path(p.name).name.split("-", 1)[0] == name:
                return p
        raise SystemExit(
            f"no patch named {name!r} in patches/series; known: "
            + ", ".join(p.name for p in self.patches)
        )

    def overlay_files(self) -> dict[str, Patch]:
        return {f: p for p in self.patches for f in p.listed("Overlay")}

    def hooked_files(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.patches:
            for d in p.diffs:
                seen.setdefault(d.path)
        return list(seen)


def series_entries(repo: Path = REPO) -> list[str]:
    entries = []
    for line in (repo / "patches" / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries.append(line)
    return entries


def load_series(repo: Path = REPO) -> Series:
    return Series([parse(repo / "patches" / e, e) for e in series_entries(repo)], repo)


def static_problems(repo: Path = REPO) -> list[str]:
    """Problems that make the series unusable before any tree is looked at."""
    problems: list[str] = []
    patches = repo / "patches"
    if not (patches / "series").exists():
        return ["patches/series is missing"]
    entries = series_entries(repo)
    for e in sorted({e for e in entries if entries.count(e) > 1}):
        problems.append(f"patches/series: {e} is listed more than once")
    on_disk = {str(p.relative_to(patches)) for p in patches.rglob("*.patch")}
    for e in entries:
        if e not in on_disk:
            problems.append(f"patches/series: {e} does not exist")
    for unused in sorted(on_disk - set(entries)):
        problems.append(f"patches/{unused}: not listed in patches/series")
    base = load_base()
    owners: dict[str, list[str]] = {}
    unreadable = False
    for e in entries:
        if e not in on_disk:
            continue
        try:
            p = parse(patches / e, e)
        except PatchFormatError as err:
            problems.append(str(err))
            unreadable = True
            continue
        for key in REQUIRED_FIELDS:
            if not p.fields.get(key):
                problems.append(f"patches/{e}: header field {key}: is missing")
        for dep in p.listed("Depends"):
            if dep not in entries[: entries.index(e)]:
                problems.append(f"patches/{e}: Depends: {dep} is not an earlier patch of the series")
        if not (p.fields.get("Bug") or p.fields.get("Bug-hybridkv")):
            problems.append(f"patches/{e}: needs a Bug: or Bug-hybridkv: field")
        if p.fields.get("Upstream-Base") not in (None, base.version):
            problems.append(
                f"patches/{e}: Upstream-Base is {p.fields['Upstream-Base']}, the series "
                f"base is {base.version}; refresh the patch against {base.version}"
            )
        for key in ("Overlay", "Tests"):
            for f in p.listed(key):
                owners.setdefault(f, []).append(e)
                if not (repo / f).is_file():
                    problems.append(f"patches/{e}: {key}: {f} does not exist")
        for f in p.listed("Overlay"):
            if not f.startswith(tuple(r + "/" for r in OVERLAY_ROOTS)):
                problems.append(f"patches/{e}: Overlay: {f} is not under vllm/")
    for f, who in sorted(owners.items()):
        if len(who) > 1:
            problems.append(f"{f}: owned by more than one patch: {', '.join(who)}")
    if unreadable:
        # The files an unreadable patch owns are unknown: listing them as
        # owned by none would only repeat its problem.
        return problems
    for root in OVERLAY_ROOTS:
        for f in sorted((repo / root).rglob("*")):
            rel = str(f.relative_to(repo))
            if f.is_file() and "__pycache__" not in rel and rel not in owners:
                problems.append(f"{rel}: overlay file not listed in any patch's Overlay: field")
    return problems
