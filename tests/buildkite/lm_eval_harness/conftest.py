# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import sys
from pathlib import Path

# .buildkite/lm-eval-harness is no package (its name has a dash, as in vLLM);
# its runner imports hybridkv_lm_eval from beside it, and so do these tests.
HARNESS = Path(__file__).resolve().parents[3] / ".buildkite" / "lm-eval-harness"
if str(HARNESS) not in sys.path:
    sys.path.insert(0, str(HARNESS))
