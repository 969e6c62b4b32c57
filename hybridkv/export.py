"""Export one patch as an upstream pull request: a diff against pristine vLLM plus its description.

The diff holds the patch's hooks, recomputed against the pristine file (so it
applies to upstream on its own), and its overlay and test files as new files.
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


def pr_diff(patch: Patch, series: Series, pristine_root: Path) -> str:
    out: list[str] = []
    for d in patch.diffs:
        old = read_lines(pristine_root / d.path)
        new = apply_hunks(old, d.hunks)
        if new is None:
            earlier = [
                p.name for p in series.patches[: series.patches.index(patch)]
                if any(x.path == d.path for x in p.diffs)
            ]
            raise SystemExit(
                f"{patch.name}: its hunks on {d.path} do not apply to pristine vLLM alone; "
                f"they build on {', '.join(earlier) or 'nothing in the series (drift?)'}. "
                "Export those first, or rebase this patch onto pristine."
            )
        out += _file_diff(d.path, old, new)
    for rel in patch.listed("Overlay") + patch.listed("Tests"):
        out += _file_diff(rel, [], read_lines(series.repo / rel))
    return "\n".join(out) + "\n"


def pr_description(patch: Patch) -> str:
    base = load_base()
    meta = [f"- {k}: {patch.fields[k]}" for k in ("Bug", "Bug-hybridkv", "Origin", "Forwarded")
            if patch.fields.get(k)]
    return (
        f"# {patch.subject}\n\n{patch.body}\n\n"
        f"---\nBased on vLLM {base.version}; exported from the hybridkv series "
        f"({patch.name}).\n" + "\n".join(meta) + "\n"
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
