"""A git working tree for editing the series, and regenerating patches/ from it.

``dev`` lays out pristine vLLM as one commit, then one commit per patch (hooks,
overlay and tests together). Edit, amend or reorder those commits with git as
usual; ``refresh`` turns them back into patches/, overlay files and tests.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

from hybridkv.base import REPO, load_base, pristine_wheel_dir
from hybridkv.series import Series
from hybridkv.patchfile import apply_hunks, join_lines, read_lines

FIELD_ORDER = ("Subject", "From", "Origin", "Bug", "Bug-hybridkv", "Forwarded",
               "Applied-Upstream", "Author", "Reviewed-by", "Last-Update", "Upstream-Base",
               "Overlay", "Tests")
DERIVED = ("Overlay", "Tests", "Patch-Name", "Subject")


def _git(cwd: Path, *args: str, input: str | None = None) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=hybridkv", "-c", "user.email=hybridkv@localhost", *args],
        cwd=cwd, check=True, capture_output=True, text=True, input=input,
    ).stdout


def _message(patch) -> str:
    trailers = [f"{k}: {v}" for k, v in patch.fields.items() if k not in DERIVED]
    trailers.append(f"Patch-Name: {patch.name}")
    return f"{patch.subject}\n\n{patch.body}\n\n" + "\n".join(trailers) + "\n"


def dev(series: Series, dest: Path, repo: Path = REPO, log=print) -> None:
    base = load_base()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    src = pristine_wheel_dir() / "vllm"
    # Compiled extensions stay out: the series never touches them and they
    # would make every git operation slow.
    shutil.copytree(src, dest / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", f"vLLM {base.version} (pristine, from the PyPI wheel)")
    _git(dest, "tag", "pristine")
    for p in series.patches:
        for d in p.diffs:
            f = dest / d.path
            new = apply_hunks(read_lines(f) if f.exists() else [], d.hunks)
            if new is None:
                raise SystemExit(f"{p.name}: does not apply in the dev tree ({d.path})")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(join_lines(new))
        for rel in p.listed("Overlay") + p.listed("Tests"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / rel, dest / rel)
        _git(dest, "add", "-A")
        _git(dest, "commit", "-q", "-F", "-", input=_message(p))
    log(f"dev tree at {dest}: tag 'pristine' + {len(series.patches)} commits")


def _parse_message(msg: str) -> tuple[dict[str, str], str]:
    paras = msg.strip("\n").split("\n\n")
    subject = paras[0].strip()
    trailer_re = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.*)$")
    fields: dict[str, str] = {}
    if len(paras) > 1 and all(trailer_re.match(x) for x in paras[-1].splitlines()):
        for line in paras[-1].splitlines():
            k, v = trailer_re.match(line).groups()
            fields[k] = v
        paras = paras[:-1]
    fields["Subject"] = subject
    return fields, "\n\n".join(paras[1:])


def refresh(src: Path, repo: Path = REPO, log=print) -> list[str]:
    """Rewrite ``repo``'s patches/, overlay and tests from the dev tree ``src``."""
    base = load_base()
    patches = repo / "patches"
    commits = _git(src, "rev-list", "--reverse", "pristine..HEAD").split()
    pristine = pristine_wheel_dir()
    names: list[str] = []
    hooked: set[str] = set()
    for c in commits:
        fields, body = _parse_message(_git(src, "log", "-1", "--format=%B", c))
        name = fields.pop("Patch-Name", None)
        if not name:
            slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\[[^]]*\]", "", fields["Subject"]).lower())
            name = f"core/{len(names) + 1:04d}-{slug.strip('-')[:50]}.patch"
        status = [line.split("\t") for line in
                  _git(src, "diff", "--name-status", "--no-renames", f"{c}^", c).splitlines()]
        added = [s[1] for s in status if s[0] == "A"]
        modified = [s[1] for s in status if s[0] != "A"]
        theirs = [f for f in modified if not (pristine / f).exists()]
        if theirs:
            raise SystemExit(
                f"commit {c[:10]} ({fields['Subject']}) changes {', '.join(theirs)}, which an "
                "earlier commit added: a file belongs to one patch. Squash the change into "
                "that commit (git commit --fixup=<it>; git rebase -i --autosquash pristine)."
            )
        overlay = [f for f in added if f.startswith("vllm/") and not (pristine / f).exists()]
        tests = [f for f in added if f.startswith("tests/")]
        hooks = modified + [f for f in added if f not in overlay and f not in tests]
        for f in overlay + tests:
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, repo / f)
        if overlay:
            fields["Overlay"] = " ".join(overlay)
        if tests:
            fields["Tests"] = " ".join(tests)
        diff = _git(src, "diff", "-U3", "--no-color", "--no-renames", "--no-ext-diff",
                    f"{c}^", c, "--", *hooks) if hooks else ""
        hooked.update(hooks)
        header = [f"{k}: {fields[k]}" for k in FIELD_ORDER if fields.get(k)]
        header += [f"{k}: {v}" for k, v in fields.items() if k not in FIELD_ORDER]
        text = "\n".join(header) + "\n\n" + body.strip("\n") + "\n---\n" + diff
        (patches / name).parent.mkdir(parents=True, exist_ok=True)
        (patches / name).write_text(text if text.endswith("\n") else text + "\n")
        names.append(name)
        log(f"refreshed patches/{name}")
    (patches / "series").write_text(
        "# Applied top to bottom by `hybridkv apply`; each patch after those it depends"
        " on. Folders name a patch's topic (core, turboquant, tools) and imply no order"
        " (see README).\n"
        + "\n".join(names) + "\n"
    )
    write_pristine_hashes(sorted(hooked), base.version, patches / "pristine.sha256")
    return names


def write_pristine_hashes(paths: list[str], version: str, dest: Path) -> None:
    pristine = pristine_wheel_dir()
    lines = [f"# sha256 of each vLLM {version} file the series hooks, as published on PyPI.",
             "# Anything else found in a tree is drift; `hybridkv refresh` rewrites this file."]
    for p in paths:
        lines.append(f"{hashlib.sha256((pristine / p).read_bytes()).hexdigest()}  {p}")
    dest.write_text("\n".join(lines) + "\n")
