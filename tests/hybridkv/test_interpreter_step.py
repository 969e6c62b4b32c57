# SPDX-License-Identifier: Apache-2.0
"""scripts/test.sh runs the README's test command without the Triton
interpreter, then an interpreter step over tests/kernels. A test elsewhere
that asks for the interpreter is skipped by the first and never reached by
the second unless that step names its file: this holds the step to it."""

import re

from hybridkv.base import REPO

# How a test asks for the interpreter (hybridkv.testing.pytest_plugin): the
# marker, or the fixtures that skip without it.
ASKS = re.compile(
    r"mark\.triton_interpret\b|def test_\w+\([^)]*\btriton_(interpret|device)\b"
)


def _interpreter_step() -> str:
    script = (REPO / "scripts" / "test.sh").read_text()
    (step,) = re.findall(r"^beside kernels .*?(?<!\\)\n", script, re.M | re.S)
    return step


def test_every_test_that_asks_for_the_interpreter_runs_in_its_step():
    step = _interpreter_step()
    assert " tests/kernels " in step
    outside = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "kernels" not in p.relative_to(REPO / "tests").parts[:1]
        and ASKS.search(p.read_text())
    )
    assert outside, "the check found no file: its pattern no longer matches"
    missing = [f for f in outside if f not in step]
    assert not missing, (
        f"{missing} ask for the Triton interpreter but scripts/test.sh's "
        "interpreter step does not run them, so CI skips their tests: add each "
        "file to the `beside kernels` line"
    )
