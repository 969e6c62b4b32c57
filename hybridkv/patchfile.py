"""Read one patch file: its DEP-3 header, PR body and unified diff; apply hunks.

Hunks apply exactly (no fuzz). A hunk whose context is not at the stated line
may still apply where it matches exactly once elsewhere; matching twice is an
ambiguous anchor and fails, as in Genesis' text patcher.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
REQUIRED_FIELDS = ("Subject", "Origin", "Forwarded", "Last-Update", "Upstream-Base")


class PatchFormatError(Exception):
    pass


@dataclass
class Hunk:
    old_start: int
    new_start: int
    lines: list[tuple[str, str]]

    @property
    def old(self) -> list[str]:
        return [t for tag, t in self.lines if tag in " -"]

    @property
    def new(self) -> list[str]:
        return [t for tag, t in self.lines if tag in " +"]


@dataclass
class FileDiff:
    path: str
    hunks: list[Hunk]
    is_new: bool = False


@dataclass
class Patch:
    name: str
    fields: dict[str, str]
    body: str
    diffs: list[FileDiff]
    text: str

    @property
    def subject(self) -> str:
        return self.fields.get("Subject", "")

    def listed(self, key: str) -> list[str]:
        return self.fields.get(key, "").split()


@dataclass
class HunkResult:
    status: str  # "apply" | "applied" | "failed"
    at: int = 0
    reason: str = ""
    detail: list[str] = field(default_factory=list)


def parse(path: Path, name: str | None = None) -> Patch:
    text = path.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        raise PatchFormatError(f"{path}: does not end with a newline")
    lines = text.split("\n")[:-1]
    try:
        sep = lines.index("---")
    except ValueError:
        raise PatchFormatError(f"{path}: no '---' line between header and diff") from None
    head, diff = lines[:sep], lines[sep + 1:]
    fields: dict[str, str] = {}
    i = 0
    while i < len(head) and head[i].strip():
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$", head[i])
        if m:
            key = m.group(1)
            fields[key] = m.group(2).strip()
        elif head[i][:1] in " \t" and fields:
            # DEP-3 folded continuation of the previous field.
            fields[key] += " " + head[i].strip()
        else:
            raise PatchFormatError(f"{path}: header line {i + 1} is not 'Field: value': {head[i]!r}")
        i += 1
    body = "\n".join(head[i:]).strip("\n")
    return Patch(name or path.name, fields, body, _parse_diff(path, diff, sep + 2), text)


def _parse_diff(path: Path, lines: list[str], first: int) -> list[FileDiff]:
    """The file diffs of ``lines``, the patch file's lines from number ``first`` on."""
    diffs: list[FileDiff] = []
    cur: FileDiff | None = None
    body: _HunkBody | None = None
    for n, line in enumerate(lines, first):
        if body is not None and not body.complete:
            if line.startswith(("diff --git ", "@@ ")):
                raise PatchFormatError(body.short(f"line {n} ({line!r})"))
            tag = line[:1] or " "
            if tag not in " +-":
                raise PatchFormatError(f"{path}: line {n}: bad hunk line {line!r}")
            body.add(tag, line[1:], n, line)
            continue
        if line.startswith("diff --git "):
            cur, body = None, None
        elif line.startswith("--- "):
            new_file = line[4:] == "/dev/null"
            cur = FileDiff(path="", hunks=[], is_new=new_file)
        elif line.startswith("+++ ") and cur is not None:
            target = line[4:]
            if not target.startswith("b/"):
                raise PatchFormatError(f"{path}: line {n}: expected 'b/' prefix: {line!r}")
            cur.path = target[2:]
            diffs.append(cur)
        elif (m := HUNK_RE.match(line)) and cur is not None:
            hunk = Hunk(old_start=int(m.group(1)), new_start=int(m.group(3)), lines=[])
            cur.hunks.append(hunk)
            body = _HunkBody(path, cur.path, len(cur.hunks), line, n, hunk,
                             int(m.group(2) or 1), int(m.group(4) or 1))
        elif line.startswith("\\ No newline"):
            raise PatchFormatError(f"{path}: line {n}: files must end with a newline")
        elif body is not None and line[:1] in " +-":
            # Outside a hunk only file headers start so: this line belongs to
            # the hunk above, whose header counts fewer lines than it holds.
            raise PatchFormatError(body.long(f"line {n} ({line!r})"))
    if body is not None and not body.complete:
        raise PatchFormatError(body.short("the end of the patch"))
    if not diffs:
        raise PatchFormatError(f"{path}: no file diffs after the '---' line")
    return diffs


@dataclass
class _HunkBody:
    """A hunk being read, against the line counts its @@ header promises.

    Without this count a patch file cut short (or a hunk edited by hand) reads
    as a shorter hunk that still applies, and the lines it lost go missing
    from the tree without a word.
    """

    patch: Path
    file: str
    number: int
    header: str
    at: int
    hunk: Hunk
    old_promised: int
    new_promised: int
    old: int = 0
    new: int = 0

    @property
    def complete(self) -> bool:
        return self.old >= self.old_promised and self.new >= self.new_promised

    def add(self, tag: str, text: str, n: int, line: str) -> None:
        old, new = self.old + (tag in " -"), self.new + (tag in " +")
        if old > self.old_promised or new > self.new_promised:
            # A context line when only added (or only removed) lines remain.
            raise PatchFormatError(self.long(f"line {n} ({line!r})"))
        self.old, self.new = old, new
        self.hunk.lines.append((tag, text))

    def _says(self) -> str:
        head = self.header.split(" @@")[0] + " @@"
        return (f"{self.patch}: {self.file} hunk {self.number} ({head}, line {self.at}): "
                f"the header promises {self.old_promised} old and {self.new_promised} new "
                f"lines, the body has {self.old} old and {self.new} new lines")

    def short(self, where: str) -> str:
        return (f"{self._says()} before {where}. A hunk must hold exactly the lines its "
                f"header counts; the patch file was cut short or edited by hand. {self._fix}")

    def long(self, where: str) -> str:
        return (f"{self._says()}, then {where} still belongs to it. A hunk must hold "
                f"exactly the lines its header counts. {self._fix}")

    @property
    def _fix(self) -> str:
        return (f"Restore the file (git checkout -- {shlex.quote(str(self.patch))}) or "
                "regenerate it from the dev tree (hybridkv refresh).")


def read_lines(path: Path) -> list[str]:
    """A text file as lines without their newlines (the form hunks apply to)."""
    text = path.read_text(encoding="utf-8")
    return text[:-1].split("\n") if text.endswith("\n") else text.split("\n")


def join_lines(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _find(lines: list[str], block: list[str]) -> list[int]:
    if not block:
        return []
    first = block[0]
    return [
        i for i in range(len(lines) - len(block) + 1)
        if lines[i] == first and lines[i:i + len(block)] == block
    ]


def locate(lines: list[str], hunk: Hunk, offset: int, reverse: bool = False) -> HunkResult:
    """Where ``hunk`` applies to ``lines`` (or un-applies, with reverse)."""
    old, new = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
    start = hunk.new_start if reverse else hunk.old_start
    want = max(start - 1 + offset, 0)
    if lines[want:want + len(old)] == old:
        return HunkResult("apply", want)
    hits = _find(lines, old)
    if len(hits) == 1:
        return HunkResult("apply", hits[0])
    if len(hits) > 1:
        return HunkResult("failed", reason="ambiguous-anchor",
                          detail=[f"context matches at lines {', '.join(str(h + 1) for h in hits)}"])
    if lines[want:want + len(new)] == new or len(_find(lines, new)) == 1:
        return HunkResult("applied")
    detail = []
    for k, exp in enumerate(old):
        got = lines[want + k] if want + k < len(lines) else "<end of file>"
        if got != exp:
            detail = [f"line {want + k + 1}: expected {exp!r}", f"line {want + k + 1}: found    {got!r}"]
            break
    return HunkResult("failed", reason="context-mismatch", detail=detail)


def apply_hunks(lines: list[str], hunks: list[Hunk], reverse: bool = False) -> list[str] | None:
    """All hunks applied in order, or None if any does not apply exactly."""
    out = list(lines)
    offset = 0
    for hunk in (reversed(hunks) if reverse else hunks):
        # Reversed hunks go last-first, so each one's new_start is still exact.
        res = locate(out, hunk, 0 if reverse else offset, reverse)
        if res.status != "apply":
            return None
        old, new = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        out[res.at:res.at + len(old)] = new
        offset += len(new) - len(old)
    return out
