# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The local-corpus perplexity task's documents: which files, how they are cut, and
that lm-eval would count the same words and bytes."""

import importlib.util
import re
from pathlib import Path

import pytest
from hybridkv_lm_eval.tasks import corpus

from .conftest import HARNESS

pytestmark = pytest.mark.cpu_test

LICENCES_PRESENT = all(Path(p).is_file() for p in corpus.DEFAULT_FILES)


def paragraphs(words_each, count, sep="\n\n"):
    """``count`` paragraphs of ``words_each`` words, numbered so order shows."""
    return sep.join(
        " ".join(f"w{p}_{i}" for i in range(words_each)) for p in range(count)
    )


def lm_eval_words(doc: str) -> int:
    """How lm-eval counts a rolling-loglikelihood document's words."""
    return len(re.split(r"\s+", doc))


@pytest.fixture(autouse=True)
def no_corpus_env(monkeypatch):
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)


# ---- cutting a text ----------------------------------------------------------------


def test_short_text_is_one_document():
    text = "  Title\n\n" + paragraphs(10, 3) + "\n\n\n"
    assert corpus.split_text(text, max_words=100) == [text.strip()]


def test_cuts_at_paragraph_boundaries_into_even_parts():
    text = paragraphs(10, 10)  # 100 words
    parts = corpus.split_text(text, max_words=40)
    assert len(parts) == 3  # the fewest parts of <= 40 words
    assert [len(p.split()) for p in parts] == [30, 40, 30]
    for part in parts:
        assert part in text and part == part.strip()
        # Never inside a paragraph: each part starts a paragraph and ends one.
        assert part.split()[0].endswith("_0") and part.split()[-1].endswith("_9")


def test_parts_keep_every_word_in_order():
    text = paragraphs(7, 23, sep="\n \n")
    for max_words in (7, 10, 30, 100, 1000):
        parts = corpus.split_text(text, max_words)
        assert [w for p in parts for w in p.split()] == text.split()
        assert all(len(p.split()) <= max_words for p in parts)


def test_long_paragraph_is_cut_at_lines_then_at_spaces():
    lines = [" ".join(f"l{n}_{i}" for i in range(6)) for n in range(5)]
    text = "\n".join(lines) + "\n\n" + " ".join(f"x{i}" for i in range(25))
    parts = corpus.split_text(text, max_words=10)
    assert all(len(p.split()) <= 10 for p in parts)
    assert [w for p in parts for w in p.split()] == text.split()
    # The 30-word paragraph is cut between its lines, not inside one.
    for part in parts:
        if part.startswith("l"):
            assert all(len(line.split()) == 6 for line in part.split("\n"))


def test_whitespace_only_text_has_no_documents():
    assert corpus.split_text(" \n\n \t\n") == []


def test_max_words_must_be_positive():
    with pytest.raises(corpus.CorpusError, match="max_words must be at least 1"):
        corpus.split_text("a b", max_words=0)


# ---- files, rows -------------------------------------------------------------------


def test_rows_name_their_source_and_match_lm_eval_counts(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text(paragraphs(50, 6) + "\n")
    b = tmp_path / "b.txt"
    b.write_text("Caf\u00e9 cr\u00e8me.\r\n\r\nSecond paragraph here.\r\n")
    rows = corpus.build_documents([a, b], max_words=120)
    assert [(r["source"], r["part"], r["parts"]) for r in rows] == [
        ("a.txt", 0, 3),
        ("a.txt", 1, 3),
        ("a.txt", 2, 3),
        ("b.txt", 0, 1),
    ]
    for r in rows:
        assert r["words"] == lm_eval_words(r["text"]) == len(r["text"].split())
        assert r["bytes"] == len(r["text"].encode("utf-8"))
        assert len(r["source_sha256"]) == 64
    assert (
        "\r" not in rows[-1]["text"] and rows[-1]["bytes"] == len(rows[-1]["text"]) + 2
    )
    summary = corpus.corpus_summary(rows)
    assert summary.startswith("4 documents, 305 words from a.txt (")


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "e.txt").write_text("\n\n")
    with pytest.raises(corpus.CorpusError, match="e.txt holds no text"):
        corpus.build_documents([tmp_path / "e.txt"])


def test_same_files_same_documents(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text(paragraphs(13, 40))
    assert corpus.build_documents([f], 100) == corpus.build_documents([f], 100)


# ---- which files -------------------------------------------------------------------


def test_metadata_wins_over_the_variable(tmp_path, monkeypatch):
    m, e = tmp_path / "m.txt", tmp_path / "e.txt"
    m.write_text("m")
    e.write_text("e")
    monkeypatch.setenv(corpus.CORPUS_ENV, str(e))
    assert corpus.corpus_files({"corpus_files": [str(m)]}) == [m]
    assert corpus.corpus_files({"corpus_files": str(m)}) == [m]
    assert corpus.corpus_files({}) == [e]


def test_variable_may_name_several_files(tmp_path, monkeypatch):
    files = [tmp_path / f"{i}.txt" for i in range(2)]
    for f in files:
        f.write_text("x")
    monkeypatch.setenv(corpus.CORPUS_ENV, ":".join(map(str, files)))
    assert corpus.corpus_files() == files


def test_default_is_the_debian_licences():
    if not LICENCES_PRESENT:
        with pytest.raises(corpus.CorpusError, match="HYBRIDKV_PPL_CORPUS"):
            corpus.corpus_files()
    else:
        assert corpus.corpus_files() == [Path(p) for p in corpus.DEFAULT_FILES]


def test_missing_file_names_it_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv(corpus.CORPUS_ENV, str(tmp_path / "nope.txt"))
    with pytest.raises(
        corpus.CorpusError,
        match=r"\$HYBRIDKV_PPL_CORPUS names files that do not exist here: "
        r"\[.*nope.txt'\].*point HYBRIDKV_PPL_CORPUS at a plain-text file",
    ):
        corpus.corpus_files()


@pytest.mark.skipif(not LICENCES_PRESENT, reason="no /usr/share/common-licenses here")
def test_default_corpus_documents():
    rows = corpus.build_documents(corpus.corpus_files())
    assert {r["source"] for r in rows} == {Path(p).name for p in corpus.DEFAULT_FILES}
    assert all(0 < r["words"] <= corpus.DEFAULT_MAX_WORDS for r in rows)
    assert all(r["words"] == lm_eval_words(r["text"]) for r in rows)
    # About 22,000 words: enough text for a perplexity that moves by less than 1 %
    # between two runs of one engine, few enough for seconds on a GPU.
    assert 15_000 < sum(r["words"] for r in rows) < 30_000


# ---- through lm-eval (where it is installed) ---------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed"
)
def test_lm_eval_loads_the_task_offline(tmp_path):
    from lm_eval.tasks import TaskManager

    text = tmp_path / "c.txt"
    text.write_text(paragraphs(30, 10))
    manager = TaskManager(
        include_path=str(HARNESS / "hybridkv_lm_eval" / "tasks"),
        metadata={"tokenizer": "unused", "corpus_files": [str(text)], "max_words": 100},
    )
    task = manager.load(["hybridkv_corpus_ppl"])["tasks"]["hybridkv_corpus_ppl"]
    docs = list(task.test_docs())
    # 30-word paragraphs, at most 100 words a document: 2 + 3 + 2 + 3 paragraphs.
    assert [d["words"] for d in docs] == [60, 90, 60, 90]
    assert task.OUTPUT_TYPE == "loglikelihood_rolling"
    assert task.doc_to_target(docs[0]) == docs[0]["text"]
    assert task.count_words(docs[0]["text"]) == docs[0]["words"]
    assert task.higher_is_better() == {
        "word_perplexity": False,
        "byte_perplexity": False,
        "bits_per_byte": False,
    }
    requests = task.construct_requests(docs[0], "", metadata=("t", 0, 1))
    (request,) = requests if isinstance(requests, list) else [requests]
    assert request.arguments == (docs[0]["text"],)
    scores = task.process_results(docs[0], [-123.0])
    assert scores["word_perplexity"] == (-123.0, docs[0]["words"])
    assert scores["bits_per_byte"] == (-123.0, docs[0]["bytes"])
