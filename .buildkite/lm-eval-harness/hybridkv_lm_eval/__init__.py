# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""hybridkv's lm-eval jobs: a candidate engine against a baseline engine, one job.

``config`` reads and checks a job's YAML, ``compare`` decides pass or fail from the
two engines' scores, ``run_side`` runs one engine through lm-eval (its own process),
and ``tasks/`` holds the offline needle-in-a-haystack tasks.
"""
