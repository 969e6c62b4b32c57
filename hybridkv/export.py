"""Export one patch as an upstream pull request: a diff against pristine vLLM plus its description.

The diff holds the patch's hooks, recomputed against the pristine file, and
its overlay and test files as new files, so it applies to vLLM as published.
A patch whose header says ``Depends: <earlier patch> ...`` is a stacked pull
request: its branch carries those patches' commits first, so against vLLM
its diff is the whole stack, which is what ``<stem>.diff`` holds (a
maintainer applies it to vLLM alone, as GitHub shows such a PR).
``<stem>.own.diff`` then holds the patch's own commit, against pristine plus
its dependencies, and the description names the stack and says to land the
dependencies first.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from hybridkv.base import load_base, pristine_wheel_dir
from hybridkv.patchfile import Patch, apply_hunks, read_lines
from hybridkv.series import Series


def _file_diff(path: str, old: list[str], new: list[str], is_new: bool) -> list[str]:
    head = [f"diff --git a/{path} b/{path}"]
    if is_new:
        head.append("new file mode 100644")
    body = list(difflib.unified_diff(
        old, new, "/dev/null" if is_new else f"a/{path}", f"b/{path}", n=3, lineterm=""
    ))
    return head + body if body else []


def dependencies(patch: Patch, series: Series) -> list[Patch]:
    """The earlier patches named in ``Depends:``, and theirs, in series order."""
    by_name = {p.name: p for p in series.patches}
    names: set[str] = set()
    todo = list(patch.listed("Depends"))
    while todo:
        name = todo.pop()
        if name in by_name and name not in names:
            names.add(name)
            todo += by_name[name].listed("Depends")
    return [p for p in series.patches[: series.patches.index(patch)] if p.name in names]


def _pristine(path: str, pristine_root: Path) -> list[str] | None:
    """``path`` as vLLM publishes it; None for a file the series adds."""
    f = pristine_root / path
    return read_lines(f) if f.exists() else None


def _stacked(patch: Patch, series: Series,
             pristine_root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{path: (pristine with the dependencies applied, and with the patch too)}
    for every file the patch or its dependencies hook."""
    deps = dependencies(patch, series)
    files = {}
    for path in dict.fromkeys(d.path for p in [*deps, patch] for d in p.diffs):
        lines = _pristine(path, pristine_root) or []
        for dep in deps:
            for d in dep.diffs:
                if d.path == path:
                    applied = apply_hunks(lines, d.hunks)
                    if applied is None:
                        raise SystemExit(
                            f"{dep.name}: does not apply to {path} for a stacked export")
                    lines = applied
        files[path] = (lines, lines)
    for d in patch.diffs:
        base, lines = files[d.path]
        new = apply_hunks(lines, d.hunks)
        if new is None:
            earlier = [
                p.name for p in series.patches[: series.patches.index(patch)]
                if any(x.path == d.path for x in p.diffs)
            ]
            raise SystemExit(
                f"{patch.name}: its hunks on {d.path} do not apply to pristine vLLM alone; "
                f"they build on {', '.join(earlier) or 'nothing in the series (drift?)'}. "
                "Name them in its Depends: field (a stacked PR), or rebase it onto pristine."
            )
        files[d.path] = (base, new)
    return files


def _new_files(patches: list[Patch], series: Series) -> list[str]:
    return [line for p in patches for rel in p.listed("Overlay") + p.listed("Tests")
            for line in _file_diff(rel, [], read_lines(series.repo / rel), is_new=True)]


def own_diff(patch: Patch, series: Series, pristine_root: Path) -> str:
    """The patch's own commit: against pristine with its dependencies applied."""
    files = _stacked(patch, series, pristine_root)
    out: list[str] = []
    for path in dict.fromkeys(d.path for d in patch.diffs):
        old, new = files[path]
        out += _file_diff(path, old, new, is_new=_pristine(path, pristine_root) is None)
    return "\n".join(out + _new_files([patch], series)) + "\n"


def pr_diff(patch: Patch, series: Series, pristine_root: Path) -> str:
    """The pull request against vLLM as published: its dependencies, then the patch."""
    files = _stacked(patch, series, pristine_root)
    out: list[str] = []
    for path, (_, new) in files.items():
        old = _pristine(path, pristine_root)
        out += _file_diff(path, old or [], new, is_new=old is None)
    return "\n".join(out + _new_files([*dependencies(patch, series), patch], series)) + "\n"


def pr_description(patch: Patch, series: Series) -> str:
    base = load_base()
    meta = [f"- {k}: {patch.fields[k]}" for k in ("Bug", "Bug-hybridkv", "Origin", "Forwarded")
            if patch.fields.get(k)]
    deps = dependencies(patch, series)
    if deps:
        meta.append(f"- Depends on (land first): {', '.join(patch.listed('Depends'))}")
        meta.append(
            f"- Stacked: {Path(patch.name).stem}.diff is this branch against vLLM "
            f"{base.version}, {', '.join(p.name for p in deps)} and then this patch, so it "
            f"applies to vLLM {base.version} alone; {Path(patch.name).stem}.own.diff is this "
            "PR's own commit, on top of them")
    author = patch.fields.get("From") or patch.fields.get("Author")
    if not author:
        raise SystemExit(
            f"{patch.name}: no From: field; vLLM requires a DCO Signed-off-by line, "
            "which names the author. Add `From: Name <email>` to the patch header."
        )
    return (
        f"# {patch.subject}\n\n{patch.body}\n\n"
        f"---\nBased on vLLM {base.version}; exported from the hybridkv series "
        f"({patch.name}).\n" + "\n".join(meta) + f"\n\nSigned-off-by: {author}\n"
    )


def export(patch: Patch, series: Series, out_dir: Path, log=print) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(patch.name).stem
    diff_path = out_dir / f"{stem}.diff"
    md_path = out_dir / f"{stem}.md"
    diff_path.write_text(pr_diff(patch, series, pristine_wheel_dir()))
    md_path.write_text(pr_description(patch, series))
    own_path = out_dir / f"{stem}.own.diff"
    if dependencies(patch, series):
        own_path.write_text(own_diff(patch, series, pristine_wheel_dir()))
        log(f"wrote {diff_path} (the stack against pristine)\nwrote {own_path}\nwrote {md_path}")
    else:
        own_path.unlink(missing_ok=True)  # an earlier export's, from when it had Depends:
        log(f"wrote {diff_path}\nwrote {md_path}")
    return diff_path, md_path
