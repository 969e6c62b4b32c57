# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Candidate vs baseline: pass when the candidate loses at most the stated tolerance.

For each configured task metric (higher is better), with the baseline's score ``b``
and the candidate's ``c`` from the same job:

    c >= b * (1 - rtol) - atol

``rtol`` is relative, as in vLLM's lm-eval-harness (there against a stored value),
and ``atol`` absorbs sampling noise on small or near-zero scores. A candidate that
scores higher than the baseline always passes. A metric missing from either run
fails, naming what the run did report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    baseline: float
    candidate: float
    rtol: float
    atol: float

    @property
    def min_acceptable(self) -> float:
        return self.baseline * (1 - self.rtol) - self.atol

    @property
    def passed(self) -> bool:
        return self.candidate >= self.min_acceptable

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{self.task} | {self.metric}: baseline={self.baseline:.4f} | "
            f"candidate={self.candidate:.4f} | min={self.min_acceptable:.4f} "
            f"(rtol={self.rtol}, atol={self.atol}) | {verdict}"
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
                )
            )
    return out
