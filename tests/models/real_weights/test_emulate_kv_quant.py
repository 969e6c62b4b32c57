# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-quantization emulator's needle mode reads the prompt raw.

``--needle`` scores the retrieval step alone: the prompt attends raw and only
the rows that predict the answer read the cache quantized. The prompt once
ran with the previous configuration's quantized layers still set, so every
case but the first of a run measured a chunk-quantized prefill and a
configuration's result depended on the one before it."""

from types import SimpleNamespace

import pytest

from tests.models.real_weights import emulate_kv_quant as emu

pytestmark = pytest.mark.cpu_test


def test_the_needle_prompt_runs_with_no_quantized_layer(monkeypatch):
    seen = []

    def forward(input_ids, past_key_values):
        seen.append((set(emu.EMU.layers), emu.EMU.answer_from))

    lm = SimpleNamespace(model=forward)
    tokenizer = lambda text, add_special_tokens: SimpleNamespace(  # noqa: E731
        input_ids=[ord(c) for c in text]
    )
    monkeypatch.setattr(emu.EMU, "layers", {3, 4})  # the last configuration's
    monkeypatch.setattr(emu.EMU, "answer_from", 7)
    case = SimpleNamespace(prompt=[1, 2, 3], number="42")
    _, answer = emu.needle_prompt(lm, tokenizer, case)
    assert seen == [(set(), None)]
    assert answer == [ord(" "), ord("4"), ord("2")]
