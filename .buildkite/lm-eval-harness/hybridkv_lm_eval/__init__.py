# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""hybridkv's lm-eval jobs: a candidate engine against a baseline engine, one job.

``config`` reads and checks a job's YAML, ``compare`` decides pass or fail from the
two engines' scores (higher or lower is better, per metric), ``run_side`` runs one
engine through lm-eval (its own process), ``sides`` keys those runs and starts
several at once, ``report`` prints the comparisons from saved scores, and ``tasks/``
holds the offline tasks: needle in a haystack, and perplexity over a local corpus.
"""
