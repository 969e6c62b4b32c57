"""Export one patch as an upstream pull request: a diff against pristine vLLM plus its description.

The diff holds the patch's hooks, recomputed against the pristine file (so it
applies to upstream on its own), and its overlay and test files as new files.
A patch whose header says ``Depends: <earlier patch> ...`` is a stacked pull
request: its hooks are recomputed against pristine plus those patches, and its
description says to land them first.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from hybridkv.base import load_base, pristine_wheel_dir
from hybridkv.patchfile import Patch, apply_hunks, read_lines
from hybridkv.series import Series


def _file_diff(path: str, old: list[str], new: list[str]) -> list[str]:
    is_new = not old
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


def _base_lines(path: str, deps: list[Patch], pristine_root: Path) -> list[str]:
    lines = read_lines(pristine_root / path)
    for dep in deps:
        for d in dep.diffs:
            if d.path == path:
                applied = apply_hunks(lines, d.hunks)
                if applied is None:
                    raise SystemExit(f"{dep.name}: does not apply to {path} for a stacked export")
                lines = applied
    return lines


def pr_diff(patch: Patch, series: Series, pristine_root: Path) -> str:
    out: list[str] = []
    deps = dependencies(patch, series)
    for d in patch.diffs:
        old = _base_lines(d.path, deps, pristine_root)
        new = apply_hunks(old, d.hunks)
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
        out += _file_diff(d.path, old, new)
    for rel in patch.listed("Overlay") + patch.listed("Tests"):
        out += _file_diff(rel, [], read_lines(series.repo / rel))
    return "\n".join(out) + "\n"


def pr_description(patch: Patch) -> str:
    base = load_base()
    meta = [f"- {k}: {patch.fields[k]}" for k in ("Bug", "Bug-hybridkv", "Origin", "Forwarded")
            if patch.fields.get(k)]
    if patch.listed("Depends"):
        meta.append(f"- Depends on (land first): {', '.join(patch.listed('Depends'))}")
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
    md_path.write_text(pr_description(patch))
    log(f"wrote {diff_path}\nwrote {md_path}")
    return diff_path, md_path
