# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Candidate vs baseline: pass when the candidate loses at most the stated tolerance.

For each configured task metric, with the baseline's score ``b`` and the
candidate's ``c`` from the same job:

    higher is better (accuracy, recall):   c >= b * (1 - rtol) - atol
    lower is better (perplexity, bits):    c <= b * (1 + rtol) + atol

``rtol`` is relative, as in vLLM's lm-eval-harness (there against a stored value),
and ``atol`` absorbs sampling noise on small or near-zero scores. A candidate that
does better than the baseline always passes. A metric's direction is its config
entry's ``higher_is_better`` when given, else lower for the names lm-eval reports
lower-is-better (``LOWER_IS_BETTER``: the perplexities and bits per byte), else
higher. A metric missing from either run fails, naming what the run did report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# lm-eval's lower-is-better metrics (higher_is_better=False in its registry) that
# its rolling-loglikelihood and loglikelihood tasks report; keyed by the name before
# the filter (``word_perplexity,none`` -> ``word_perplexity``).
LOWER_IS_BETTER = frozenset(
    {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}
)


def higher_is_better(metric: dict[str, Any]) -> bool:
    """The direction of one configured metric (a job config's ``metrics`` entry)."""
    if "higher_is_better" in metric:
        return bool(metric["higher_is_better"])
    return metric["name"].split(",", 1)[0] not in LOWER_IS_BETTER


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    baseline: float
    candidate: float
    rtol: float
    atol: float
    higher_is_better: bool = True

    @property
    def min_acceptable(self) -> float:
        """The lowest passing score of a higher-is-better metric."""
        return self.baseline * (1 - self.rtol) - self.atol

    @property
    def max_acceptable(self) -> float:
        """The highest passing score of a lower-is-better metric."""
        return self.baseline * (1 + self.rtol) + self.atol

    @property
    def bound(self) -> float:
        return self.min_acceptable if self.higher_is_better else self.max_acceptable

    @property
    def passed(self) -> bool:
        if self.higher_is_better:
            return self.candidate >= self.min_acceptable
        return self.candidate <= self.max_acceptable

    @property
    def relative_change(self) -> float | None:
        """(candidate - baseline) / baseline; None when the baseline is 0."""
        if self.baseline == 0:
            return None
        return (self.candidate - self.baseline) / self.baseline

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        name, sign = ("min", ">=") if self.higher_is_better else ("max", "<=")
        change = self.relative_change
        delta = "" if change is None else f" ({change:+.2%})"
        return (
            f"{self.task} | {self.metric}: baseline={self.baseline:.4f} | "
            f"candidate={self.candidate:.4f}{delta} | {name}={self.bound:.4f} "
            f"(candidate {sign} {name}; rtol={self.rtol}, atol={self.atol}) | "
            f"{verdict}"
        )


class MissingMetric(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def _score(
    scores: dict[str, dict[str, Any]], role: str, task: str, metric: str
) -> float:
    if task not in scores:
        raise MissingMetric(
            f"the {role} run reported no task {task!r}; it reported {sorted(scores)}"
        )
    if metric not in scores[task]:
        reported = sorted(
            k for k in scores[task] if not k.endswith("_stderr") and "," in k
        )
        raise MissingMetric(
            f"the {role} run reported no metric {metric!r} for {task}; "
            f"it reported {reported}"
        )
    value = scores[task][metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MissingMetric(
            f"the {role} run's {task} {metric} is not a number: {value!r}"
        )
    return float(value)


def compare(
    config: dict[str, Any],
    baseline: dict[str, dict[str, Any]],
    candidate: dict[str, dict[str, Any]],
) -> list[Comparison]:
    """One Comparison per configured task metric; ``baseline`` and ``candidate`` are
    lm-eval's ``results["results"]`` (task -> metric -> value) of each run."""
    out = []
    for task in config["tasks"]:
        for metric in task["metrics"]:
            out.append(
                Comparison(
                    task=task["name"],
                    metric=metric["name"],
                    baseline=_score(baseline, "baseline", task["name"], metric["name"]),
                    candidate=_score(
                        candidate, "candidate", task["name"], metric["name"]
                    ),
                    rtol=float(metric.get("rtol", config["rtol"])),
                    atol=float(metric.get("atol", config["atol"])),
                    higher_is_better=higher_is_better(metric),
                )
            )
    return out
