# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tolerance rule, per metric: candidate >= baseline * (1 - rtol) - atol when
higher is better, candidate <= baseline * (1 + rtol) + atol when lower is."""

import pytest
from hybridkv_lm_eval.compare import (
    LOWER_IS_BETTER,
    Comparison,
    MissingMetric,
    compare,
    higher_is_better,
)

pytestmark = pytest.mark.cpu_test


def make_config(rtol=0.05, atol=0.0, metric_overrides=None):
    metric = {"name": "exact_match,strict-match", **(metric_overrides or {})}
    return {
        "rtol": rtol,
        "atol": atol,
        "tasks": [
            {"name": "gsm8k", "metrics": [metric]},
            {"name": "hybridkv_niah_4k", "metrics": [{"name": "niah_recall,none"}]},
        ],
    }


def scores(gsm8k, niah):
    return {
        "gsm8k": {
            "exact_match,strict-match": gsm8k,
            "exact_match,strict-match_stderr": 0.01,
        },
        "hybridkv_niah_4k": {"niah_recall,none": niah, "alias": "hybridkv_niah_4k"},
    }


@pytest.mark.parametrize(
    "baseline,candidate,rtol,atol,passed",
    [
        (0.80, 0.80, 0.05, 0.0, True),
        (0.80, 0.76, 0.05, 0.0, True),  # exactly 0.80 * 0.95
        (0.80, 0.7599, 0.05, 0.0, False),
        (0.80, 0.75, 0.05, 0.01, True),  # 0.76 - 0.01
        (0.80, 0.95, 0.05, 0.0, True),  # better than the baseline
        (0.0, 0.0, 0.08, 0.0, True),  # both at zero (a random-weight model)
        (1.0, 0.92, 0.08, 0.0, True),
        (1.0, 0.90, 0.08, 0.0, False),
    ],
)
def test_rule(baseline, candidate, rtol, atol, passed):
    c = Comparison("t", "m", baseline, candidate, rtol, atol)
    assert c.min_acceptable == pytest.approx(baseline * (1 - rtol) - atol)
    assert c.passed is passed
    assert ("ok" if passed else "FAIL") in c.line()


def test_compare_every_configured_metric():
    out = compare(make_config(), scores(0.8, 1.0), scores(0.79, 0.5))
    assert [(c.task, c.metric, c.passed) for c in out] == [
        ("gsm8k", "exact_match,strict-match", True),
        ("hybridkv_niah_4k", "niah_recall,none", False),
    ]


def test_metric_tolerance_overrides_job_tolerance():
    config = make_config(
        rtol=0.0, atol=0.0, metric_overrides={"rtol": 0.1, "atol": 0.05}
    )
    gsm8k, niah = compare(config, scores(0.8, 1.0), scores(0.67, 1.0))
    assert (gsm8k.rtol, gsm8k.atol, gsm8k.passed) == (0.1, 0.05, True)
    assert (niah.rtol, niah.atol) == (0.0, 0.0)


def test_missing_task_names_what_was_reported():
    with pytest.raises(
        MissingMetric,
        match=r"candidate run reported no task 'hybridkv_niah_4k'.*\['gsm8k'\]",
    ):
        compare(make_config(), scores(0.8, 1.0), {"gsm8k": scores(0.8, 1.0)["gsm8k"]})


def test_missing_metric_names_what_was_reported():
    baseline = scores(0.8, 1.0)
    baseline["gsm8k"] = {"exact_match,flexible-extract": 0.8}
    with pytest.raises(
        MissingMetric,
        match=r"baseline run reported no metric 'exact_match,strict-match'"
        r".*flexible-extract",
    ):
        compare(make_config(), baseline, scores(0.8, 1.0))


def test_non_numeric_score_is_an_error():
    with pytest.raises(MissingMetric, match="not a number"):
        compare(make_config(), scores("N/A", 1.0), scores(0.8, 1.0))


# ---- lower is better (perplexity, bits per byte) -----------------------------------


@pytest.mark.parametrize(
    "baseline,candidate,rtol,atol,passed",
    [
        (20.0, 20.0, 0.05, 0.0, True),
        (20.0, 21.0, 0.05, 0.0, True),  # exactly 20 * 1.05
        (20.0, 21.001, 0.05, 0.0, False),
        (20.0, 21.4, 0.05, 0.5, True),  # 21 + 0.5
        (20.0, 21.6, 0.05, 0.5, False),
        (20.0, 15.0, 0.0, 0.0, True),  # better than the baseline
        (0.80, 0.8039, 0.005, 0.0, True),  # bits per byte: 0.80 * 1.005 = 0.804
        (0.80, 0.8041, 0.005, 0.0, False),
    ],
)
def test_rule_lower_is_better(baseline, candidate, rtol, atol, passed):
    c = Comparison("t", "m", baseline, candidate, rtol, atol, higher_is_better=False)
    assert c.max_acceptable == pytest.approx(baseline * (1 + rtol) + atol)
    assert c.bound == c.max_acceptable
    assert c.passed is passed
    line = c.line()
    assert ("ok" if passed else "FAIL") in line
    assert "max=" in line and "candidate <= max" in line


def test_higher_is_better_line_keeps_its_min():
    c = Comparison("t", "m", 0.8, 0.7, 0.05, 0.0)
    assert c.bound == c.min_acceptable == pytest.approx(0.76)
    assert "min=0.7600" in c.line() and "candidate >= min" in c.line()
    assert "(-12.50%)" in c.line()


def test_relative_change_with_a_zero_baseline():
    assert Comparison("t", "m", 0.0, 0.0, 0.08, 0.0).relative_change is None
    assert "FAIL" not in Comparison("t", "m", 0.0, 0.0, 0.08, 0.0).line()


@pytest.mark.parametrize(
    "metric,expected",
    [
        ({"name": "word_perplexity,none"}, False),
        ({"name": "byte_perplexity,none"}, False),
        ({"name": "bits_per_byte,none"}, False),
        ({"name": "perplexity,none"}, False),
        ({"name": "niah_recall,none"}, True),
        ({"name": "exact_match,strict-match"}, True),
        # The config entry's word wins over the known names.
        ({"name": "word_perplexity,none", "higher_is_better": True}, True),
        ({"name": "loss,none", "higher_is_better": False}, False),
    ],
)
def test_direction_of_a_metric(metric, expected):
    assert higher_is_better(metric) is expected


def test_known_lower_is_better_names_match_lm_eval():
    """The names lm-eval registers as lower-is-better for (rolling) loglikelihood."""
    pytest.importorskip("lm_eval.api.metrics")  # registers them
    registry = pytest.importorskip("lm_eval.api.registry")
    for name in LOWER_IS_BETTER:
        assert registry.is_higher_better(name) is False, name


def ppl_config(**metric):
    return {
        "rtol": 0.05,
        "atol": 0.05,
        "tasks": [
            {"name": "hybridkv_niah_4k", "metrics": [{"name": "niah_recall,none"}]},
            {
                "name": "hybridkv_corpus_ppl",
                "metrics": [
                    {"name": "word_perplexity,none", "rtol": 0.02, "atol": 0.0},
                    {"name": "bits_per_byte,none", "rtol": 0.005, **metric},
                ],
            },
        ],
    }


def ppl_scores(recall, word_ppl, bpb):
    return {
        "hybridkv_niah_4k": {
            "niah_recall,none": recall,
            "niah_recall_stderr,none": 0.05,
        },
        "hybridkv_corpus_ppl": {
            "word_perplexity,none": word_ppl,
            "word_perplexity_stderr,none": "N/A",
            "bits_per_byte,none": bpb,
            "bits_per_byte_stderr,none": "N/A",
        },
    }


def test_compare_mixes_directions_in_one_job():
    baseline = ppl_scores(0.90, 39.4, 0.839)
    # Recall within 0.9 * 0.95 - 0.05; perplexity 1.5 % up (rtol 2 %); bits per
    # byte 0.7 % up against 0.5 % allowed, with the job's atol 0.05 added: passes.
    out = compare(ppl_config(), baseline, ppl_scores(0.81, 40.0, 0.845))
    assert [(c.metric, c.higher_is_better, c.passed) for c in out] == [
        ("niah_recall,none", True, True),
        ("word_perplexity,none", False, True),
        ("bits_per_byte,none", False, True),
    ]
    # Without the job's atol, that bits-per-byte rise fails.
    out = compare(ppl_config(atol=0.0), baseline, ppl_scores(0.81, 40.0, 0.845))
    assert [c.passed for c in out] == [True, True, False]
    # A perplexity that drops (better) passes whatever the tolerance.
    out = compare(ppl_config(atol=0.0), baseline, ppl_scores(0.95, 30.0, 0.70))
    assert all(c.passed for c in out)
    # A rise beyond rtol fails; so would the same scores read as higher-is-better.
    worse = ppl_scores(0.90, 41.0, 0.839)
    assert not compare(ppl_config(), baseline, worse)[1].passed


def test_config_can_flip_a_direction():
    baseline = ppl_scores(0.9, 39.4, 0.839)
    out = compare(
        ppl_config(higher_is_better=True, atol=0.0),
        baseline,
        ppl_scores(0.9, 39.4, 0.80),
    )
    assert out[2].higher_is_better is True and not out[2].passed
