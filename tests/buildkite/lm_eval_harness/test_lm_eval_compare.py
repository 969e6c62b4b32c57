# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tolerance rule: candidate >= baseline * (1 - rtol) - atol, per metric."""

import pytest
from hybridkv_lm_eval.compare import Comparison, MissingMetric, compare

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
