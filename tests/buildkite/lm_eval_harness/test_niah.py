# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The offline NIAH generator: deterministic, sized in the model's tokens, needle
where it says it is."""

import importlib.util
import subprocess
import sys

import pytest
from hybridkv_lm_eval.tasks import niah

from .conftest import HARNESS

pytestmark = pytest.mark.cpu_test


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.fixture(scope="module")
def byte_tokens(tmp_path_factory):
    """The tiny models' byte-level tokenizer (one token per byte), through
    transformers as lm-eval loads it."""
    transformers = pytest.importorskip("transformers")
    from tests.models.tiny_hybrids.tokenizer import write_tokenizer

    path = write_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def test_same_seed_same_samples():
    a = niah.make_samples(words, 5, context_length=600, seed=7)
    b = niah.make_samples(words, 5, context_length=600, seed=7)
    assert a == b
    c = niah.make_samples(words, 5, context_length=600, seed=8)
    assert [s["input"] for s in a] != [s["input"] for s in c]


def test_sample_does_not_depend_on_how_many_are_built():
    assert niah.make_samples(words, 6, context_length=600)[4] == niah.make_sample(
        words, 4, context_length=600
    )


def test_same_in_a_fresh_interpreter():
    """str seeds hash the same in every process (no PYTHONHASHSEED dependence)."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]);"
        "from hybridkv_lm_eval.tasks import niah;"
        "s = niah.make_sample(lambda t: len(t.split()), 3, context_length=500);"
        "print(json.dumps(s))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(HARNESS)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout
    import json

    assert json.loads(out) == niah.make_sample(words, 3, context_length=500)


@pytest.mark.parametrize("context_length", [300, 1000, 4096])
@pytest.mark.parametrize("max_gen_toks,reserve", [(32, 16), (64, 0)])
def test_prompt_fills_its_token_budget(context_length, max_gen_toks, reserve):
    budget = context_length - max_gen_toks - reserve
    for sample in niah.make_samples(
        words,
        4,
        context_length=context_length,
        max_gen_toks=max_gen_toks,
        reserve_tokens=reserve,
    ):
        assert sample["prompt_tokens"] == words(sample["input"]) <= budget
        # At most one filler sentence short of the budget.
        longest = max(words(" " + s) for s in _all_filler_sentences())
        assert sample["prompt_tokens"] > budget - longest


@pytest.mark.parametrize("context_length", [1024, 4096, 32768])
def test_prompt_length_in_the_model_tokenizer(byte_tokens, context_length):
    budget = context_length - niah.DEFAULT_MAX_GEN_TOKS - niah.DEFAULT_RESERVE_TOKENS
    for sample in niah.make_samples(byte_tokens, 2, context_length=context_length):
        assert (
            sample["prompt_tokens"]
            == byte_tokens(sample["input"])
            == len(sample["input"].encode())
        )
        assert budget - 100 < sample["prompt_tokens"] <= budget


def _all_filler_sentences():
    return [
        f"{s} {v} {o} {t}."
        for s in niah._SUBJECTS
        for v in niah._VERBS
        for o in niah._OBJECTS
        for t in niah._TAILS
    ]


def _needle_position(sample):
    """(sentences before the needle, filler sentences in all)."""
    needle = niah.NEEDLE.format(key=sample["key"], value=sample["target"])
    body = sample["input"].removeprefix(niah.INSTRUCTION)
    body = body[: body.index(niah.QUESTION.format(key=sample["key"])[:20])]
    before = body[: body.index(needle)]
    return before.count(". "), sample["filler_sentences"]


def test_needle_sits_at_its_depth():
    for sample in niah.make_samples(words, 20, context_length=3000):
        assert sample["input"].count(sample["target"]) == 1
        before, total = _needle_position(sample)
        assert before == round(sample["depth"] * total)


def test_depths_spread_over_the_context_in_any_prefix():
    """lm-eval's ``limit`` keeps the first N samples: whatever N, no stretch of the
    context is left without a needle for long (an even spread has gaps of 1/N)."""
    assert niah.needle_depth(0) == 0.0
    for n in range(2, 300):
        depths = sorted(niah.needle_depth(i) for i in range(n))
        assert all(0 <= d < 1 for d in depths)
        gaps = [b - a for a, b in zip(depths, depths[1:])] + [1 - depths[-1]]
        assert max(gaps) < 2 / n


def test_question_asks_for_the_needle_key_and_distractors_differ():
    sample = niah.make_sample(words, 2, context_length=800, num_distractors=3)
    assert sample["input"].endswith(niah.QUESTION.format(key=sample["key"]))
    assert sample["input"].count("special magic numbers for") == 4
    assert sample["input"].count(f"special magic numbers for {sample['key']} ") == 1


def test_budget_too_small_says_what_to_change():
    with pytest.raises(
        ValueError,
        match=r"needs \d+ tokens before any filler.*context_length 80 leaves 32"
        r".*raise context_length",
    ):
        niah.make_sample(words, 0, context_length=80)


def test_score():
    assert niah.score("1234567", " 1234567.") == 1.0
    assert niah.score("1234567", " 123456") == 0.0
    assert niah.score("1234567", "The number is 1234567") == 1.0
    assert niah.score("1234567", " 12345678") == 0.0
    assert niah.process_results({"target": "42"}, [" it is 42"]) == {"niah_recall": 1.0}


@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed"
)
def test_lm_eval_loads_the_task_offline(tmp_path):
    from lm_eval.tasks import TaskManager

    from tests.models.tiny_hybrids.tokenizer import write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    manager = TaskManager(
        include_path=str(HARNESS / "hybridkv_lm_eval" / "tasks"),
        metadata={"tokenizer": str(tok), "context_length": 512, "num_samples": 3},
    )
    task = manager.load(["hybridkv_niah"])["tasks"]["hybridkv_niah"]
    docs = list(task.test_docs())
    assert len(docs) == 3 and all(d["prompt_tokens"] <= 512 - 48 for d in docs)
    assert task.doc_to_text(docs[0]) == docs[0]["input"]
