# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Speculative verify rows name their requests in TurboQuant's metadata, so a
raw window (``turboquant.raw_window``) reads each row's request's row of the
twin's block table, in a decode-only step and in a mixed step's decode half."""

from tests.v1.attention.test_turboquant_verify_rows import Runner, _builder


def test_verify_rows_name_their_requests():
    meta = _builder(num_spec=3).build(0, Runner().step([4, 4], [100, 200]))
    assert meta.decode_requests.tolist() == [0] * 4 + [1] * 4


def test_a_mixed_steps_decode_half_keeps_them():
    meta = _builder(num_spec=3).build(0, Runner().step([4, 2, 40], [100, 200, 40]))
    decode, _ = meta.mixed_parts
    assert (meta.num_decodes, meta.num_decode_tokens) == (2, 6)
    assert decode.decode_requests.tolist() == [0] * 4 + [1] * 2
