# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Perplexity over a local text corpus: documents built from files on disk, no download.

The default corpus is the licence texts Debian's (and Ubuntu's) ``base-files``
package installs under ``/usr/share/common-licenses``: about 22,000 words of plain
English prose that any Debian-family machine holds. Another corpus is one or more
text files, named in the job's task metadata (``corpus_files``: a list, or one path)
or in the environment variable ``HYBRIDKV_PPL_CORPUS`` (paths separated by
``os.pathsep``); the metadata wins over the variable, the variable over the default.
Every named file must exist: a partial corpus would change the score silently.

Each file becomes one or more documents: a file of more than ``max_words``
whitespace-separated words is cut at paragraph boundaries (blank lines) into the
fewest parts that each hold at most ``max_words`` words, balanced in length, so that
the documents do not depend on the model or its tokenizer. A paragraph longer than
``max_words`` on its own is cut at line ends, a line longer than that at spaces.
A document is the exact text of its part of the file, surrounding whitespace
stripped.

lm-eval scores each document with ``loglikelihood_rolling`` (the task YAML's
``output_type``) and reports ``word_perplexity``, ``byte_perplexity`` and
``bits_per_byte``, aggregated over all documents as lm-eval does for every rolling
loglikelihood task; lower is better for all three.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tests.models.real_weights.corpus import LICENCE_TEXTS

CORPUS_ENV = "HYBRIDKV_PPL_CORPUS"
# One list for every measurement on the real weights (the repository root is on
# the path: run-lm-eval-real-weights.sh puts it there).
DEFAULT_FILES = LICENCE_TEXTS
DEFAULT_MAX_WORDS = 4096

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\f\v\r]*\n\s*")


class CorpusError(ValueError):
    pass


def corpus_files(metadata: dict[str, Any] | None = None) -> list[Path]:
    """The corpus files: the metadata's ``corpus_files``, else ``$HYBRIDKV_PPL_CORPUS``,
    else the Debian licence texts."""
    given = (metadata or {}).get("corpus_files")
    if given:
        names = [given] if isinstance(given, (str, os.PathLike)) else list(given)
        origin = "the task metadata's corpus_files"
    elif os.environ.get(CORPUS_ENV):
        names = [p for p in os.environ[CORPUS_ENV].split(os.pathsep) if p]
        origin = f"${CORPUS_ENV}"
    else:
        names = list(DEFAULT_FILES)
        origin = "the default corpus (Debian's licence texts)"
    paths = [Path(os.path.expanduser(str(n))) for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CorpusError(
            f"{origin} names files that do not exist here: {missing}. The default "
            f"corpus comes with Debian's or Ubuntu's base-files package; elsewhere, "
            f"point {CORPUS_ENV} at a plain-text file (several: separated by "
            f"{os.pathsep!r}) or set corpus_files in the job's task metadata"
        )
    return paths


def _spans(text: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """(start, end) of the non-blank pieces of ``text`` between matches of
    ``pattern``, surrounding whitespace excluded."""
    out, start = [], 0
    for m in [*pattern.finditer(text), None]:
        end = m.start() if m else len(text)
        piece = text[start:end]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            out.append((start + lead, start + len(piece.rstrip())))
        if m:
            start = m.end()
    return out


def _words(text: str) -> int:
    return len(text.split())


def _units(text: str, max_words: int) -> list[tuple[int, int, int]]:
    """(start, end, words) of the pieces a file may be cut between: paragraphs,
    and lines or runs of words where a paragraph alone is over ``max_words``."""
    units = []
    for start, end in _spans(text, _PARAGRAPH_BREAK):
        if _words(text[start:end]) <= max_words:
            units.append((start, end, _words(text[start:end])))
            continue
        for ls, le in _spans(text[start:end], re.compile(r"\n")):
            ls, le = start + ls, start + le
            line_words = [m.span() for m in re.finditer(r"\S+", text[ls:le])]
            for i in range(0, len(line_words), max_words):
                chunk = line_words[i : i + max_words]
                units.append((ls + chunk[0][0], ls + chunk[-1][1], len(chunk)))
    # Lines of one long paragraph come back one by one; packing merges them again.
    return units


def split_text(text: str, max_words: int = DEFAULT_MAX_WORDS) -> list[str]:
    """``text`` cut at paragraph boundaries into the fewest parts of at most
    ``max_words`` words each, as even in length as those boundaries allow."""
    if max_words < 1:
        raise CorpusError(f"max_words must be at least 1, found {max_words}")
    units = _units(text, max_words)
    if not units:
        return []
    total = sum(w for _, _, w in units)
    parts = max(1, -(-total // max_words))
    while True:
        groups = _pack(units, parts, max_words)
        if groups is not None:
            break
        parts += 1
    return [text[g[0][0] : g[-1][1]] for g in groups]


def _pack(
    units: list[tuple[int, int, int]], parts: int, max_words: int
) -> list[list[tuple[int, int, int]]] | None:
    """``units`` in ``parts`` consecutive groups of at most ``max_words`` words,
    each cut made where the running total is nearest to its even share; None when
    such cuts leave a group over the limit."""
    total = sum(w for _, _, w in units)
    groups: list[list[tuple[int, int, int]]] = [[]]
    done = 0
    for unit in units:
        group_words = sum(w for _, _, w in groups[-1])
        target = total * len(groups) / parts
        over_limit = group_words + unit[2] > max_words
        # Cut before this unit when that lands nearer the group's even share.
        nearer = abs(done - target) <= abs(done + unit[2] - target)
        if groups[-1] and len(groups) < parts and (over_limit or nearer):
            groups.append([])
        groups[-1].append(unit)
        done += unit[2]
    if any(sum(w for _, _, w in g) > max_words for g in groups):
        return None
    return groups


def build_documents(
    paths: Iterable[str | os.PathLike], max_words: int = DEFAULT_MAX_WORDS
) -> list[dict[str, Any]]:
    """One row per document: its text and where it came from."""
    rows = []
    for path in paths:
        path = Path(path)
        raw = path.read_bytes()
        text = raw.decode("utf-8").replace("\r\n", "\n")
        pieces = split_text(text, max_words)
        if not pieces:
            raise CorpusError(f"{path} holds no text")
        for i, piece in enumerate(pieces):
            rows.append(
                {
                    "text": piece,
                    "source": path.name,
                    "part": i,
                    "parts": len(pieces),
                    "words": _words(piece),
                    "bytes": len(piece.encode("utf-8")),
                    "source_sha256": hashlib.sha256(raw).hexdigest(),
                }
            )
    return rows


def corpus_summary(rows: Sequence[dict[str, Any]]) -> str:
    """One line naming the corpus, for the logs: what was scored."""
    sources: dict[str, str] = {}
    for r in rows:
        sources.setdefault(r["source"], r["source_sha256"][:12])
    words = sum(r["words"] for r in rows)
    described = ", ".join(f"{name} ({sha})" for name, sha in sources.items())
    return f"{len(rows)} documents, {words} words from {described}"


# ---- lm-eval hook (imported by lm-eval from the task YAML) ------------------------


def build_dataset(**metadata: Any) -> dict[str, Any]:
    """``custom_dataset`` of hybridkv_corpus_ppl: the test split, built from local
    files (lm-eval passes the task's metadata, the runner's merged over it)."""
    import datasets

    rows = build_documents(
        corpus_files(metadata), int(metadata.get("max_words", DEFAULT_MAX_WORDS))
    )
    print(f"hybridkv_corpus_ppl: {corpus_summary(rows)}", file=sys.stderr)
    return {"test": datasets.Dataset.from_list(rows)}
