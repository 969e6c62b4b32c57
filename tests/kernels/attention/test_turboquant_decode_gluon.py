# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Gluon stage 1 of the split-KV TurboQuant decode against float64.

``decode_attention`` takes the Gluon stage 1 on sm_89+ GPUs wherever it
serves; these tests route to it themselves.

Off the GPU (the Triton interpreter session, ``HYBRIDKV_TRITON_INTERPRET=1``)
the kernel's body runs on NumPy (``gluon_numpy``: logical semantics, NumPy
models of its inline asm and mma) behind the real ``decode_attention`` call,
whose split merge runs under the Triton interpreter; the reference and the
cases are the split-KV tests'. On a GPU (``gpu`` tests) the kernel runs
natively against the same reference and the Triton stage 1, and
``test_turboquant_decode_splitkv``'s GPU tests (real shapes, CUDA-graph
replay) take it wherever it serves.
"""

import functools
import importlib
import inspect
import logging
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.kernels.attention import gluon_numpy, turboquant_packed
from tests.kernels.attention.turboquant_packed import (
    PRESETS,
    TOL,
    check_decode,
    decode,
    fp16_bytes,
    packed_case,
    poisoned,
    reference_attention,
    stored_cache,
    tables,
)
from vllm.logger import _print_info_once
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as splitkv
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops import turboquant_device
from vllm.v1.attention.ops.turboquant_pair_code import pair_codebook

pytest.importorskip("triton.experimental.gluon")
gluon_decode = importlib.import_module("vllm.v1.attention.ops.gluon_turboquant_decode")
gluon_static_compile = importlib.import_module(
    "tests.kernels.attention.gluon_static_compile"
)


@pytest.fixture
def gluon_on_numpy(monkeypatch):
    """Route decode_attention to the Gluon stage 1, run on NumPy; returns the
    list of launch grids, to see that it ran."""
    grids = []
    run = gluon_numpy.runner()

    def runner(kernel, grid, args, constexprs):
        grids.append(grid)
        run(kernel, grid, args, constexprs)

    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", runner)
    monkeypatch.setattr(gluon_decode, "_tables", {})
    return grids


# (preset, head_dim, query heads per KV head, seq_lens, splits): 16-bit and
# 32-bit word paths, one to four warps, GQA 2-8, a padding row, one token, a
# partial tile, a page boundary, one split and several.
CASES = [
    ("turboquant_k8v4", 128, 4, [0, 1, 19, 45, 70], None),
    ("turboquant_4bit_nc", 128, 6, [0, 1, 19, 45, 70], None),
    ("turboquant_k8v4", 256, 6, [19, 45], 1),
    ("turboquant_4bit_nc", 256, 8, [33, 2], 3),
    ("turboquant_k8v4", 512, 8, [17], 2),
    ("turboquant_4bit_nc", 512, 2, [40], 1),
    ("turboquant_k3v4_nc", 128, 4, [0, 1, 19, 45, 70], None),
    ("turboquant_k3v4_nc", 256, 6, [33, 2], 3),
    ("turboquant_k3v4_nc", 512, 8, [17], 1),
    ("turboquant_3bit_nc", 128, 6, [0, 1, 19, 45, 70], None),
    ("turboquant_3bit_nc", 256, 4, [33, 2], 3),
    ("turboquant_3bit_nc", 512, 2, [40], 1),
]


@pytest.mark.parametrize(("preset", "head_dim", "gqa", "seq_lens", "splits"), CASES)
def test_gluon_stage1_matches_float64(
    triton_interpret, gluon_on_numpy, preset, head_dim, gqa, seq_lens, splits
):
    check_decode(
        triton_interpret,
        preset,
        head_dim,
        gqa,
        seq_lens,
        num_kv_heads=1 if head_dim == 512 else 2,
        splits=splits,
    )
    assert gluon_on_numpy, "decode_attention did not take the Gluon stage 1"


# Keys coded by pairs (3bit_nc's layout, a pair codebook): one to four warps,
# a padding row, one token, partial tiles, one split and several.
PAIR_CASES = [
    (128, 6, [0, 1, 19, 45, 70], None),
    (256, 4, [33, 2], 3),
    (512, 2, [40], 1),
]


@pytest.mark.parametrize(("head_dim", "gqa", "seq_lens", "splits"), PAIR_CASES)
def test_gluon_stage1_reads_pair_codes(
    triton_interpret, gluon_on_numpy, head_dim, gqa, seq_lens, splits
):
    check_decode(
        triton_interpret, "turboquant_3bit_nc", head_dim, gqa, seq_lens,
        num_kv_heads=1 if head_dim == 512 else 2, splits=splits, pairs=True,
    )  # fmt: skip
    assert gluon_on_numpy, "decode_attention did not take the Gluon stage 1"


def test_gluon_stage1_serves_padded_pages_and_verify_rows(
    triton_interpret, gluon_on_numpy
):
    # An even page padding keeps 16/32-bit words; verify rows share a block
    # table row with growing lengths (patch 0008), padding rows are empty.
    check_decode(
        triton_interpret, "turboquant_k8v4", 128, 6, [19, 45, 0], splits=2, pad_bytes=96
    )
    lens = [29, 30, 31, 32, 0]
    check_decode(
        triton_interpret,
        "turboquant_4bit_nc",
        128,
        4,
        lens,
        table=lambda t: t[:1].expand(len(lens), -1),
    )
    assert len(gluon_on_numpy) == 2


@pytest.fixture
def load_log(monkeypatch):
    """Each program's global loads on the NumPy runner, in program order:
    ``{program id: [(buffer dtype, elements read), ...]}``, the programs in
    the order they ran (a GPU's dispatch order)."""
    log = {}
    language = gluon_numpy._language

    def recording(pid, grid):
        gl = language(pid, grid)
        load = gl.load
        entries = log.setdefault(pid, [])

        def logged(ptr, mask=None, other=0):
            _, m = gluon_numpy._masked(ptr, mask)
            entries.append((ptr.buf.dtype, int(m.sum())))
            return load(ptr, mask, other)

        gl.load = logged
        return gl

    monkeypatch.setattr(gluon_numpy, "_language", recording)
    return log


@pytest.mark.parametrize("head_dim", [128, 256])
def test_a_program_reads_its_query_once_beside_its_first_block(
    triton_interpret, gluon_on_numpy, load_log, head_dim
):
    """Three loads wait on each other before a program's first tile: the row's
    length, the first page's block, that page's words. The query goes out with
    the block, once: its dot operand's rows 8-15 (the fp16 remainders) come
    from the same registers as rows 0-7. Read by chunk and by operand row,
    after the length, an MSE program at head_dim 256 spent 10 of 99 us
    before its first tile (H100, 16 x 8K)."""
    group = 6
    check_decode(
        triton_interpret, "turboquant_4bit_nc", head_dim, group, [40], splits=1
    )
    assert gluon_on_numpy
    loads = load_log[(0, 0, 0)]
    # The rotated query is the only fp32 buffer a program reads.
    query = [i for i, (dtype, _) in enumerate(loads) if dtype == np.float32]
    assert [loads[i][1] for i in query] == [group * head_dim], loads
    # Before it: the row's length and the first page's block, one int32 each.
    assert loads[: query[0]] == [(np.int32, 1), (np.int32, 1)], loads


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_an_empty_split_loads_only_its_row_length(
    triton_interpret, gluon_on_numpy, load_log, preset
):
    """A split past the end of a short row stores the lse = -inf the merge
    skips and stops: no query, table or first-tile loads. Those made 7,200
    empty programs (150 rows of 640 tokens, 9 splits) cost 80 of stage 1's
    207 us on an H100. The output still matches float64 (the scratch is
    NaN-poisoned, so a missing lse would show)."""
    # 16 tokens per split at least: row 0 fills splits 0-1 of 4, row 1 0-2.
    # Program ids are (KV head, row, split).
    check_decode(triton_interpret, preset, 128, 4, [19, 45], num_kv_heads=1, splits=4)
    loads = {pid: len(entries) for pid, entries in load_log.items()}
    assert len(loads) == 8
    empty = {pid for pid, n in loads.items() if n == 1}
    assert empty == {(0, 0, 2), (0, 0, 3), (0, 1, 3)}, loads


def test_a_batch_of_short_rows_sends_its_live_splits_first(
    triton_interpret, gluon_on_numpy, load_log
):
    """A GPU hands blocks out x first. With the splits last in the grid,
    every row's first split goes out before any second one, so in a batch of
    equally short rows all live splits go out before the first empty one;
    interleaved with the empty ones (splits first), 150 rows of 640 tokens
    at 9 splits took 121 us on an H100 where they take 100 now."""
    # 3 rows of 40 tokens, 8 splits of at least 16 tokens: splits 0-2 live.
    check_decode(
        triton_interpret, "turboquant_k8v4", 128, 4, [40] * 3, num_kv_heads=2, splits=8
    )
    assert gluon_on_numpy == [(2, 3, 8)]
    # An empty split loads its length only.
    live = [len(entries) > 1 for entries in load_log.values()]
    assert sum(live) == 2 * 3 * 3
    assert live == sorted(live, reverse=True), list(load_log)


def test_a_small_batch_splits_into_the_spare_scratch_rows(
    triton_interpret, gluon_on_numpy
):
    # One row on the interpreter's 4 SMs: the default count (16) is past the
    # scratch's 8 splits per row, and the row past the batch holds the rest.
    check_decode(triton_interpret, "turboquant_k8v4", 128, 4, [70], num_kv_heads=1)
    assert [g[2] for g in gluon_on_numpy] == [16]


@pytest.mark.parametrize(
    "fault",
    [
        "value nibble order",
        "value token pairs swapped",
        "value high nibbles unscaled",
        "key byte order",
        "MSE key tails unsigned",
        "MSE key squares' top plane dropped",
        "3-bit key codes one bit late",
        "3-bit value codes one bit late",
    ],
)
def test_a_fault_in_the_unpacking_turns_the_check_red(
    triton_interpret, monkeypatch, fault
):
    """The NumPy check sees a permutation error in either operand, and the
    MSE key lookup's asm (run on ``gluon_numpy.ptx``) faults that move
    scores by ~2**-12: a tail without its sign, or squares without their
    top byte plane."""
    models = dict(gluon_numpy.MODELS)
    preset = "turboquant_4bit_nc"
    if fault.startswith("3-bit"):
        keys = "key" in fault
        helper = gluon_decode._spread3

        def late(asm):
            if (asm == gluon_decode._MSE3_SPREAD.value) != keys:
                return asm  # the other field's spread
            wrong = asm.replace("$4, $5, 24;", "$4, $5, 25;")
            assert wrong != asm
            return wrong

        models[helper.fn.__name__] = lambda *args: gluon_numpy.call(
            helper, *args, rewrite=late
        )
        preset = "turboquant_k3v4_nc" if keys else "turboquant_3bit_nc"
    elif fault.startswith("MSE"):
        helper = (
            gluon_decode._mse_centroids
            if "tails" in fault
            else gluon_decode._mse_squares
        )
        calls = []

        def rewrite(asm):
            calls.append(None)
            if "tails" in fault:
                # Each chunk looks up its heads, then its tails: fault the
                # tails, leaving the sign bit unset.
                if len(calls) % 2:
                    return asm
                wrong = re.sub(r"lop3[^;]*;", "", asm)
            else:
                wrong = asm.replace("mad.lo.u32 $0, a2, 65536, a0;", "mov.b32 $0, a0;")
            assert wrong != asm
            return wrong

        models[helper.fn.__name__] = lambda *args: gluon_numpy.call(
            helper, *args, rewrite=rewrite
        )
    elif fault.startswith("value"):
        helper = gluon_decode._u4x8_pairs_to_f16
        text, fix = {
            "value nibble order": ("shr.b32 s0, x0, 8;", "shr.b32 s0, x0, 4;"),
            "value token pairs swapped": ("0x5410;", "0x1054;"),
            "value high nibbles unscaled": ("0x2C002C00;", "0x3C003C00;"),
        }[fault]

        def rewrite(asm):
            wrong = asm.replace(text, fix)
            assert wrong != asm
            return wrong

        models[helper.fn.__name__] = lambda *args: gluon_numpy.call(
            helper, *args, rewrite=rewrite
        )
    else:

        def wrong(w):
            f = list(gluon_numpy.MODELS["_e4m3x4_to_f16"](w))
            return f[1], f[0], f[2], f[3]

        models["_e4m3x4_to_f16"] = wrong
        preset = "turboquant_k8v4"
    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", gluon_numpy.runner(models))
    with pytest.raises(AssertionError, match="max error"):
        check_decode(triton_interpret, preset, 128, 4, [45, 70])


def _fp16_levels(monkeypatch):
    """The split-KV tests' caches quantized to the solver's centroids rounded
    to fp16 values, as TurboQuant layers hold them (patch 0020)."""
    solved = get_centroids
    monkeypatch.setattr(
        turboquant_packed,
        "get_centroids",
        lambda d, b: solved(d, b).half().float(),
    )


def _growing_scores(cfg, cache, table):
    """Key norms x4 per page along each row (a row's max score outgrows its
    running max by more than 2**8 from the third page on), value scales of
    2-3 x 10**4 on page 1, where the max grows by less: p * scale would
    overflow fp16 at the stale max."""
    mse = cfg.key_packed_size - 2  # the key norm follows the codes
    vscale = cfg.key_packed_size + cfg.head_dim * cfg.effective_value_quant_bits // 8
    shape = cache.shape[1:-1]
    for row in table.cpu():
        for j, block in enumerate(row[row >= 0].tolist()):
            norms = (torch.rand(shape) * 3 + 0.5) * 4.0**j
            cache[block, ..., mse : mse + 2] = fp16_bytes(norms).to(cache.device)
            if j == 1:
                scales = torch.rand(shape) * 10000 + 20000
                bytes_ = fp16_bytes(scales).to(cache.device)
                cache[block, ..., vscale : vscale + 2] = bytes_


@pytest.mark.parametrize(
    "fault",
    [None, "max never moves after the first tile", "value scales not checked"],
)
def test_the_running_max_moves_where_scores_outgrow_it(
    triton_interpret, gluon_on_numpy, monkeypatch, fault
):
    """The stage 1 rescales its sums only where a row's max grew by more
    than 2**8, or a value scale could overflow fp16; exact either way. Held
    at the first tile's max, growing scores overflow; without the scale's
    condition, p * scale does (red)."""
    if fault == "max never moves after the first tile":
        monkeypatch.setattr(gluon_decode, "_STALE_LOG2", 1e9)
        monkeypatch.setattr(gluon_decode, "_STALE_SCALE_MAX", 1e9)
    elif fault:
        monkeypatch.setattr(gluon_decode, "_STALE_SCALE_MAX", 1e9)
    run = lambda: check_decode(  # noqa: E731
        triton_interpret, "turboquant_4bit_nc", 128, 4, [45, 70], num_kv_heads=1,
        splits=1, edit=_growing_scores,
    )  # fmt: skip
    if fault:
        with (
            pytest.raises(AssertionError, match="max error|NaN"),
            np.errstate(over="ignore", invalid="ignore"),
        ):
            run()
    else:
        run()
    assert gluon_on_numpy


def _gram_fault(fault: str):
    """An ``mma_v2`` model that faults the key Gram dots (the ones whose A
    operand is the B operand's transpose): it drops every fourth chunk, or
    the dimensions of warps past the first."""
    grams = []

    def mma(a, b, acc, input_precision=None):
        a, b = np.asarray(a), np.asarray(b)
        if np.array_equal(a, b.transpose(0, 2, 1)):
            grams.append(None)
            if "chunk" in fault and len(grams) % 4 == 0:
                return gluon_numpy._t(np.asarray(acc))
            if "warps" in fault:
                b = b.copy()
                b[1:] = 0
        return gluon_numpy.MODELS["mma_v2"](a, b, acc, input_precision)

    return mma


@pytest.mark.parametrize(
    ("preset", "head_dim", "fault"),
    [
        ("turboquant_4bit_nc", 128, None),
        ("turboquant_4bit_nc", 256, None),
        ("turboquant_k3v4_nc", 256, None),
        ("turboquant_3bit_nc", 512, None),
        ("turboquant_4bit_nc", 128, "tails skipped where centroids have them"),
        ("turboquant_4bit_nc", 128, "key Gram misses a chunk"),
        ("turboquant_4bit_nc", 256, "key Gram misses the other warps"),
    ],
)
def test_fp16_centroids_take_one_dot_per_chunk(
    triton_interpret, monkeypatch, preset, head_dim, fault
):
    """Centroids that are fp16 values have zero tails: the stage 1 skips
    their lookup and dot, takes the keys' squared norms (norm correction)
    from the diagonal of their Gram matrix on the tensor cores, and still
    matches float64. Skipping the tails for centroids that are not fp16
    values moves scores by ~2**-12 (red), and so does a Gram that misses a
    chunk of dimensions or another warp's slice."""
    fp16 = fault is None or "Gram" in fault
    if fp16:
        _fp16_levels(monkeypatch)
    else:
        monkeypatch.setattr(gluon_decode, "key_tails", lambda centroids: False)
    tails = []
    models = {"mma_v2": _gram_fault(fault)} if fault and "Gram" in fault else {}
    run = gluon_numpy.runner(models)

    def runner(kernel, grid, args, constexprs):
        tails.append(constexprs["TAILS"])
        assert constexprs["GRAM"] and not constexprs["SQUARES"]
        run(kernel, grid, args, constexprs)

    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", runner)
    monkeypatch.setattr(gluon_decode, "_tables", {})
    if fault is None:
        check_decode(triton_interpret, preset, head_dim, 4, [19, 45], splits=2)
    else:
        with pytest.raises(AssertionError, match="max error"):
            check_decode(triton_interpret, preset, head_dim, 4, [19, 45], splits=2)
    assert tails == [False]


@pytest.mark.parametrize(
    ("preset", "buffer"),
    [("turboquant_k8v4", "scores"), ("turboquant_4bit_nc", "key Gram")],
)
def test_a_warp_that_reads_only_its_own_partials_turns_the_check_red(
    triton_interpret, monkeypatch, preset, buffer
):
    """At head_dim 256 two warps each score half of the dimensions; their
    partial scores, and with fp16 centroids their key Gram matrices, meet
    in shared memory once a tile. A warp that read back only its own partial
    (the others' as 0) moves scores: the float64 check turns red."""
    _fp16_levels(monkeypatch)
    load = gluon_numpy._Shared.load
    loads = []

    def own_only(self, layout):
        x = load(self, layout)
        if x.dtype == np.float32 and x.shape == (2, 16, 16):
            loads.append(None)
            # Per tile the scores' buffer is read first, then the Gram's.
            if (buffer == "key Gram") == (len(loads) % 2 == 0):
                x[1:] = 0
        return x

    monkeypatch.setattr(gluon_numpy._Shared, "load", own_only)
    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", gluon_numpy.runner())
    monkeypatch.setattr(gluon_decode, "_tables", {})
    with pytest.raises(AssertionError, match="max error"):
        check_decode(triton_interpret, preset, 256, 4, [19, 45], splits=2)
    assert loads


# (preset, head_dim, KV heads, page padding, read as shifted 32-bit words).
SHIFTED_CASES = [
    ("turboquant_4bit_nc", 128, 2, 0, True),  # both parities of slot start
    ("turboquant_4bit_nc", 256, 4, 4, True),  # padded by a whole word
    ("turboquant_4bit_nc", 512, 2, 0, False),  # spilled, no faster (NOTES)
    ("turboquant_4bit_nc", 128, 1, 0, False),  # token stride 134 bytes
    ("turboquant_4bit_nc", 128, 2, 2, False),  # page stride 2 past a word
    ("turboquant_k3v4_nc", 128, 2, 0, False),  # 3-bit keys: 16-bit words
    ("turboquant_k8v4", 128, 2, 0, False),  # whole words already
]


@pytest.mark.parametrize(
    ("preset", "head_dim", "num_kv_heads", "pad_bytes", "shifted"), SHIFTED_CASES
)
def test_4bit_slots_are_read_as_shifted_words(
    triton_interpret, monkeypatch, preset, head_dim, num_kv_heads, pad_bytes, shifted
):
    """turboquant_4bit_nc slots are 2 bytes longer than a multiple of 4; where
    the page and token strides are whole words they are read as 32-bit words
    all the same (``shifted_slots``), against float64 like every other path."""
    seen = []
    run = gluon_numpy.runner()

    def runner(kernel, grid, args, constexprs):
        seen.append(constexprs["SHIFTED"])
        run(kernel, grid, args, constexprs)

    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", runner)
    check_decode(
        triton_interpret,
        preset,
        head_dim,
        2,
        [19, 45],
        num_kv_heads=num_kv_heads,
        pad_bytes=pad_bytes,
        splits=2,
    )
    assert seen == [shifted]


def test_shifted_slots_need_the_value_field_2_bytes_off():
    """_stage1 finds the norm, scale and zero of a shifted slot by its value
    field starting 2 bytes past its key field's word alignment; a key field
    of whole words would read the wrong half-words, so it is refused."""
    layout = dict(
        head_dim=128, group=4, page=16, key_fp8=False, mse_bits=4,
        key_packed_size=64, norm_correction=True, word32=False, split=True,
        min_split_tokens=256, value_bits=4, tails=False, stride_cp=67, pdl=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="2 bytes longer than a multiple of 4"):
        gluon_decode._constexprs(**layout, shifted=True)
    assert not gluon_decode._constexprs(**layout)["SHIFTED"]


def test_a_launch_passes_its_constexprs_as_one_mapping_built_once(monkeypatch):
    """Each stage 1 launch of a configuration hands ``CompiledLaunch`` the
    same mapping of constexprs and launch options, built on its first
    launch: copied into keyword arguments per launch, the 35 constexprs
    took 2.3 µs of host time a launch on a CPU host, paid by every
    TurboQuant layer of every step outside a full CUDA graph."""
    layout = dict(
        head_dim=128, group=4, page=16, key_fp8=False, mse_bits=4,
        key_packed_size=66, norm_correction=True, word32=False, split=True,
        min_split_tokens=256, value_bits=4, tails=False, stride_cp=67, pdl=True,
    )  # fmt: skip
    constexprs = gluon_decode._constexprs(**layout)
    calls = []

    class Recorder:
        def launch_with(self, grid, args, options, variant):
            calls.append((grid, args, options, variant))

    monkeypatch.setattr(gluon_decode, "launcher", lambda kernel: Recorder())
    for rows in (3, 5):
        gluon_decode._launch(gluon_decode._stage1, (8, rows, 2), ("q",), constexprs)
    (grid, args, options, variant), second = calls
    assert (grid, args) == ((8, 3, 2), ("q",))
    assert second[0] == (8, 5, 2) and second[2] is options and second[3] is variant
    assert dict(options) == dict(
        constexprs, num_warps=constexprs["W"], maxnreg=gluon_decode.MAX_REGISTERS,
        launch_pdl=True,
    )  # fmt: skip


@pytest.mark.parametrize("field", ["key", "value"])
def test_a_shifted_field_without_its_last_half_word_turns_the_check_red(
    triton_interpret, monkeypatch, field
):
    """The half-word a shifted field loses to the word before it is put back
    from the scalar words; dropped, the odd KV head's scores (keys) or the
    even one's last 4 output dimensions (values) are wrong."""
    models = dict(gluon_numpy.MODELS)
    helper = gluon_decode._funnel
    calls = []

    def funnel(lo, hi, shift):
        calls.append(None)
        out = gluon_numpy.call(helper, lo, hi, shift)
        # Per tile: the value scale, the zero, the key norm, then the patch;
        # the patch's shift is 0 for even KV heads (values), 32 for odd.
        if len(calls) % 4 == 0 and (np.asarray(shift) == 32).all() == (field == "key"):
            return out * 0
        return out

    models[helper.fn.__name__] = funnel
    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon_decode)
    monkeypatch.setattr(gluon_decode, "_launch", gluon_numpy.runner(models))
    with pytest.raises(AssertionError, match="max error"):
        check_decode(triton_interpret, "turboquant_4bit_nc", 128, 4, [45, 70])


@pytest.mark.parametrize("fault", [None, "the first cache's token stride kept"])
def test_each_cache_compiles_with_its_own_token_stride(
    triton_interpret, gluon_on_numpy, monkeypatch, fault
):
    """The token stride is a constant of the compiled stage 1 (its loads take
    it as immediates), so it must come from each cache: 1 KV head (67 16-bit
    words), then 4 (134 32-bit words: ``shifted_slots``; 2 heads would be
    67 again). Kept from the first cache, the second reads other tokens'
    words (red)."""
    if fault:
        real, first = gluon_decode._constexprs, []
        signature = inspect.signature(real)

        def stale(*args, **kwargs):
            # By name: the stride is not the last argument of every release.
            bound = signature.bind(*args, **kwargs)
            first.append(bound.arguments["stride_cp"])
            bound.arguments["stride_cp"] = first[0]
            return real(*bound.args, **bound.kwargs)

        monkeypatch.setattr(gluon_decode, "_constexprs", stale)
    check_decode(triton_interpret, "turboquant_4bit_nc", 128, 4, [45], num_kv_heads=1)
    second = lambda: check_decode(  # noqa: E731
        triton_interpret, "turboquant_4bit_nc", 128, 4, [19, 45], num_kv_heads=4
    )
    if fault:
        with pytest.raises(AssertionError, match="max error"):
            second()
    else:
        second()
    assert len(gluon_on_numpy) == 2


def _decode_table(table: torch.Tensor):
    """Every nibble through the kernel's own asm (on ``gluon_numpy.ptx``):
    the [16] fp16 heads and [16] centroids (heads + tails, unscaled) by
    nibble value, [16] sums of 8 squares (nibbles ``nib``), and the scale."""
    assert table.shape == (32, gluon_decode.TABLE_WORDS)  # one row per lane
    assert (table == table[0]).all()
    words = table[0].cpu().numpy().astype(np.int64)
    # Each nibble value at each of the 8 positions of a word.
    nib = (np.arange(16)[:, None] + 5 * np.arange(8)[None, :]) % 16
    w = (nib << (4 * np.arange(8))).sum(1)
    w = np.where(w >= 2**31, w - 2**32, w).astype(np.int32)
    sel, pos0, pos1 = gluon_numpy.call(gluon_decode._mse_select, w)
    lookup = gluon_decode._mse_centroids
    out_h = gluon_numpy.call(lookup, sel, pos0, pos1, *words[0:4])
    out_t = gluon_numpy.call(lookup, sel, pos0, pos1, *words[4:8])
    heads = np.zeros(16, np.float16)
    tails = np.zeros(16, np.float16)
    for i in range(8):
        heads[nib[:, i]] = out_h[i]
        tails[nib[:, i]] = out_t[i]
    for i in range(8):  # the same nibble decodes alike at every position
        assert np.array_equal(heads[nib[:, i]], out_h[i])
        assert np.array_equal(tails[nib[:, i]], out_t[i])
    sq_scale, key_scale = words[14:16].astype(np.uint32).view(np.float32)
    sums = gluon_numpy.call(gluon_decode._mse_squares, sel, *words[8:14])
    # the word of nibbles n + 5 i (mod 16) holds 8 of the 16 values
    values = (heads.astype(np.float64) + tails.astype(np.float64)) * key_scale
    return heads, values, np.asarray(sums, np.float64) * sq_scale, nib, key_scale


@pytest.mark.parametrize("head_dim", [128, 256, 512])
def test_key_table_decodes_every_nibble(monkeypatch, head_dim):
    """The table and the asm that reads it give, for every nibble at every
    position of a key word, the (scaled) centroid's fp16 head, a tail
    holding it to 2**-22 of the largest, and the word's squared centroids to
    2**-21 (fixed point)."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", head_dim)
    centroids = tables(cfg, head_dim, "cpu")[0]
    table = gluon_decode.key_table(centroids)
    assert table.dtype == torch.int32
    assert gluon_decode.key_table(centroids) is table  # built once
    heads, got, sums, nib, key_scale = _decode_table(table)
    c = centroids.double().numpy()
    assert 0.5 <= np.abs(c).max() / key_scale < 1  # scaled by a power of two
    assert np.array_equal(heads, (c / key_scale).astype(np.float16))
    assert np.abs(got - c).max() <= 2**-22 * np.abs(c).max()
    want = (c[nib] ** 2).sum(1)
    assert np.abs(sums - want).max() <= 2**-21 * want.max()


def test_value_words_pair_two_tokens_per_register():
    """Output 2 i + t of two tokens' value words is nibble i of token t, as
    exact fp16, for every nibble value at every position (the B operand of
    the value dot pairs two tokens of one dimension). Through the kernel's
    asm on ``gluon_numpy.ptx``."""
    nib = (
        np.arange(16)[:, None, None]
        + 5 * np.arange(8)[None, None, :]
        + 3 * np.arange(2)[None, :, None]
    ) % 16  # [16, token, nibble]
    w = (nib << (4 * np.arange(8))).sum(-1)
    w = np.where(w >= 2**31, w - 2**32, w).astype(np.int32)
    out = gluon_numpy.call(gluon_decode._u4x8_pairs_to_f16, w[:, 0], w[:, 1])
    got = np.stack([np.asarray(o) for o in out], -1).reshape(16, 8, 2)
    assert got.dtype == np.float16
    assert np.array_equal(got, nib.transpose(0, 2, 1).astype(np.float16))


@pytest.mark.parametrize(("asm", "bias"), [("_MSE3_SPREAD", 4), ("_U3_SPREAD", 0)])
def test_3bit_codes_spread_to_nibbles(asm, bias):
    """Code i of a 96-bit group (bit 3 i, across word boundaries at codes 10
    and 21) becomes nibble i of the 4-bit words: plus 4 for keys (the 4-bit
    lookup's sign bit and magnitude for 8 symmetric centroids), as is for
    values. Through the kernel's asm on ``gluon_numpy.ptx``."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8, size=(64, 32))
    bits = sum(codes[:, i].astype(object) << (3 * i) for i in range(32))
    words = np.array([[(b >> (32 * k)) & 0xFFFFFFFF for k in range(3)] for b in bits])
    w = np.where(words >= 2**31, words - 2**32, words).astype(np.int32)
    asm = getattr(gluon_decode, asm).value
    out = gluon_numpy.call(gluon_decode._spread3, w[:, 0], w[:, 1], w[:, 2], asm)
    got = np.stack([np.asarray(o).astype(np.int64) & 0xFFFFFFFF for o in out], -1)
    nibbles = (got[:, :, None] >> (4 * np.arange(8))) & 15  # [64, 4 words, 8]
    assert np.array_equal(nibbles.reshape(64, 32), codes + bias)


def test_key_table_decodes_every_3bit_code(monkeypatch):
    """3-bit keys (turboquant_k3v4_nc): the table of 8 symmetric centroids,
    read through the 4-bit lookup at nibble code + 4, gives each centroid to
    2**-22 of the largest."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k3v4_nc", 128)
    centroids = tables(cfg, 128, "cpu")[0]
    assert centroids.shape == (8,)
    table = gluon_decode.key_table(centroids)
    assert table is not None
    got = _decode_table(table)[1]
    c = centroids.double().numpy()
    assert np.abs(got[4:12] - c).max() <= 2**-22 * np.abs(c).max()


def test_asymmetric_centroids_get_no_table(monkeypatch, caplog_vllm):
    """The lookup reads 8 magnitudes and a sign: centroids that are not 8 or
    16 and symmetric get no table, so decode_attention keeps the Triton stage 1
    (exact for any centroids) rather than a wrong one, and says so once."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    _print_info_once.cache_clear()
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    c = tables(cfg, 128, "cpu")[0]
    shifted = c.clone()
    shifted[3] += 1e-3
    with caplog_vllm.at_level(logging.INFO, logger="vllm"):
        assert gluon_decode.key_table(shifted) is None
    assert "symmetric about 0" in caplog_vllm.text
    assert "the Triton stage 1 serves them" in caplog_vllm.text
    assert gluon_decode.key_table(c[:8].clone()) is None  # 8, not symmetric
    assert gluon_decode.key_table(c[:4].clone()) is None  # 4
    points = pair_codebook(128)
    points[5, 1] += 1e-4  # no longer an fp16 value
    assert gluon_decode.key_table(points) is None
    assert gluon_decode.key_table(c.clone()) is not None


@pytest.mark.parametrize("head_dim", [128, 512])
def test_pair_table_gathers_every_point_at_every_position(monkeypatch, head_dim):
    """Each of a key word's four bytes, spread from two 3-bit fields (index
    % 8 first), gathers its point: dimensions 2m and 2m + 1 of the word get
    the point's two coordinates, exactly. Through the kernel's helper on
    ``gluon_numpy``."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    points = pair_codebook(head_dim)
    table = gluon_decode.key_table(points)
    assert table.shape == (64,) and table.dtype == torch.int32
    assert not gluon_decode.key_tails(points)
    idx = (np.arange(64)[:, None] + 17 * np.arange(4)[None, :]) % 64  # [64, pair]
    nib = np.stack([idx % 8, idx // 8], -1).reshape(64, 8)  # U3 spread: no bias
    w = (nib << (4 * np.arange(8))).sum(-1)
    w = np.where(w >= 2**31, w - 2**32, w).astype(np.int32)
    out = gluon_numpy.call(gluon_decode._pair_points, w, gluon_numpy.Pointer.of(table))
    got = np.stack([np.asarray(o) for o in out], -1)
    assert got.dtype == np.float16
    want = points.numpy()[idx].reshape(64, 8)
    assert np.array_equal(got.astype(np.float32), want)


def test_key_table_builds_nothing_while_a_graph_is_captured(monkeypatch):
    """Building the table allocates and launches kernels, which a capture
    would record: while capturing, a table not built before gives None (the
    Triton stage 1 runs) and one built before is reused."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    c = tables(cfg, 128, "cpu")[0]

    class OnCuda:  # the centroids, seen as a CUDA tensor
        data_ptr, device, is_cuda, float = c.data_ptr, c.device, True, c.float

    fake = OnCuda()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gluon_decode.key_table(fake) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    built = gluon_decode.key_table(fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gluon_decode.key_table(fake) is built


def test_key_table_is_rebuilt_for_other_centroids_at_the_same_address(monkeypatch):
    """A table belongs to one centroid tensor: others that take its address
    after it is freed (another engine in this process) get a new table, not
    the stale one."""
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    memory = tables(cfg, 128, "cpu")[0].clone()
    first = memory[:]  # one tensor on this memory...
    old = gluon_decode.key_table(first).clone()
    del first
    memory.mul_(0.5)  # ...freed, and other centroids written there
    second = memory[:]
    assert second.data_ptr() == memory.data_ptr()
    table = gluon_decode.key_table(second)
    assert not torch.equal(table, old)
    got = _decode_table(table)[1]
    assert np.abs(got - memory.double().numpy()).max() < 1e-7
    assert gluon_decode.key_table(second) is table  # then built once
    # Inference tensors (vLLM runs the model under inference mode) work too.
    with torch.inference_mode():
        frozen = memory.clone()
    assert torch.equal(gluon_decode.key_table(frozen), table)


@pytest.mark.parametrize(
    ("layout", "served"),
    [
        ((128, 4, 16, True, 0, 4), True),
        ((256, 6, 16, False, 4, 4), True),
        ((512, 8, 32, True, 0, 4), True),
        ((64, 4, 16, True, 0, 4), False),  # less than one warp's slice
        ((384, 4, 16, True, 0, 4), False),  # three warps
        ((128, 4, 24, True, 0, 4), False),  # pages of 24 tokens
        ((128, 4, 16, False, 3, 4), True),  # 3-bit keys
        ((128, 4, 16, False, 4, 3), True),  # 3-bit values
        ((128, 4, 16, False, 3, 3), True),  # 3-bit keys and values
        ((128, 4, 16, False, 4, 2), False),  # 2-bit values
        ((128, 12, 16, True, 0, 4), False),  # more than 8 heads per KV head
    ],
)
def test_what_the_gluon_stage1_serves(layout, served):
    assert gluon_decode.serves(*layout) is served


def test_decode_keeps_the_triton_stage1_where_gluon_does_not_serve(
    triton_interpret, gluon_on_numpy
):
    check_decode(
        triton_interpret, "turboquant_4bit_nc", 128, 4, [19, 45], splits=2, pad_bytes=97
    )  # odd page size: byte loads
    assert not gluon_on_numpy


@pytest.mark.parametrize("key_fp8", [True, False])
def test_query_chunk_rows_fall_in_distinct_banks(key_fp8):
    """Every tile reloads the query chunks from shared memory with ldmatrix,
    which reads 8 rows of 16 bytes per 8 x 8 matrix in one wavefront only if
    the 8 pieces sit in distinct 4-bank groups. Without a swizzle the rows
    (64 or 128 bytes long) shared banks: ncu counted ~70 % of the loop's
    shared wavefronts as bank conflicts (benchmarks/NOTES.md, "Release 12").
    The addresses follow Triton's swizzle rule for the kernel's layout."""
    cfg = gluon_decode.launch_config(128, key_fp8, word32=key_fp8)
    qc, smem = cfg["QC"], cfg["Q_SMEM"]
    assert list(smem.order)[0] == 2, "the chunk's columns must be contiguous"

    def byte_address(row, col):  # fp16 element (row, col) of one chunk
        phase = (row // smem.per_phase) % smem.max_phase
        piece = (col // smem.vec) ^ phase
        return 2 * (row * qc + piece * smem.vec + col % smem.vec)

    for first_row in (0, 8):
        for col in range(0, qc, 8):
            groups = [byte_address(first_row + r, col) // 16 % 8 for r in range(8)]
            assert sorted(groups) == list(range(8)), (
                f"query chunk of {qc} fp16: the 8 rows of the 16-byte piece at "
                f"column {col} (rows {first_row}+) fall in bank groups "
                f"{groups}; ldmatrix needs 8 distinct groups to read them in "
                f"one wavefront. Swizzle the chunk's shared layout by row."
            )


@pytest.mark.parametrize(
    ("registers", "warps"),
    [(128, 16), (168, 12), (169, 8), (186, 8), (226, 8), (255, 8)],
)
def test_resident_warps_count_per_scheduler(registers, warps):
    """An SM's 4 schedulers each hold their warps' registers in their own
    16,384. Counted over the SM's 65,536, 172-180 registers a thread would
    keep 10 warps (5 two-warp programs at head_dim 256); ncu's register
    limit reads 4 programs, and split for 5, k3v4_nc and 3bit_nc at head_dim
    256 took 1.3-1.4x as long (H100, benchmarks/NOTES.md, "Release 19")."""
    assert gluon_decode.resident_warps(registers) == warps


def test_stage1_launches_under_its_register_cap(monkeypatch):
    """The split count assumes ``resident_warps()``, which holds only if the
    launch compiles under ``MAX_REGISTERS``."""
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append(options)

    monkeypatch.setattr(gluon_decode, "_stage1", Launcher())
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, cfg.slot_size_aligned, dtype=torch.uint8)
    out = torch.zeros(1, 4, 128)
    gluon_decode.stage1(
        q, cache, torch.zeros(1, 2, dtype=torch.int32),
        torch.tensor([20], dtype=torch.int32), None, out, out, 1.0, 1, 256, 4,
        cfg.key_packed_size, cfg.key_mse_bits, False, True,
    )  # fmt: skip
    assert len(launches) == 1
    assert launches[0]["maxnreg"] == gluon_decode.MAX_REGISTERS
    assert gluon_decode.resident_warps() == 12


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    ("head_dim", "gqa", "key_tails"),
    [(128, 4, False), (256, 6, False), (512, 8, False), (128, 4, True)],
)
def test_gluon_stage1_compiles_for_sm90(preset, head_dim, gqa, key_tails):
    """What the NumPy run cannot see: the kernel compiles for sm_90 (no GPU
    needed; ptxas ships with Triton) and every layout conversion marked
    trivial is one. Layers' centroids are fp16 values (no key tails); the
    tails' dot serves any others."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        # gl.sum and friends become interpreter functions, which compile
        # cannot take; the session without the interpreter runs this.
        pytest.skip("compiled in the session without the Triton interpreter")
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    if key_tails and cfg.key_fp8:
        pytest.skip("FP8 keys have no centroids")
    kernel = gluon_static_compile.static_compile(
        head_dim,
        gqa,
        cfg.key_fp8,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.norm_correction,
        cfg.slot_size_aligned,
        value_bits=cfg.value_quant_bits,
        key_tails=key_tails,
    )
    assert kernel.metadata.num_warps == head_dim // 128
    assert "mma.sync" in kernel.asm["ptx"]
    # Under the register cap the split count's resident warps assume.
    assert f".maxnreg {gluon_decode.MAX_REGISTERS}" in kernel.asm["ptx"]
    # No dequantized value crosses threads: the only shared-memory traffic
    # is the packed words, the query chunks and the cross-warp score sum.
    assert kernel.metadata.shared <= 64 * 1024


@pytest.mark.parametrize("head_dim", [128, 256, 512])
def test_pair_code_stage1_compiles_for_sm90(head_dim):
    """Keys coded by pairs: the stage 1 that gathers their points compiles
    for sm_90 under the register cap."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled in the session without the Triton interpreter")
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", head_dim)
    kernel = gluon_static_compile.static_compile(
        head_dim, 4, False, 3, cfg.key_packed_size, True, cfg.slot_size_aligned,
        value_bits=3, key_tails=False, pairs=True,
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert "mma.sync" in ptx and f".maxnreg {gluon_decode.MAX_REGISTERS}" in ptx


def test_pairs_are_3bit_mse_keys():
    with pytest.raises(ValueError, match="coded by pairs are 3-bit MSE keys"):
        gluon_decode._constexprs(
            128, 4, 16, False, 4, 66, True, False, True, 256, 4, False, 1000,
            True, pairs=True,
        )  # fmt: skip


@pytest.mark.parametrize(("arch", "pdl"), [(90, True), (89, False)])
def test_stage1_waits_for_the_kernel_ahead_before_any_load(arch, pdl):
    """Launched programmatically (sm_90+), stage 1 starts while the kernel
    before it runs: every load and store must follow ``griddepcontrol.wait``,
    or it reads a query the rotation has not written. sm_89 has no such
    instruction and is launched in order."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled in the session without the Triton interpreter")
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    kernel = gluon_static_compile.static_compile(
        128, 4, False, cfg.key_mse_bits, cfg.key_packed_size,
        cfg.norm_correction, cfg.slot_size_aligned, arch=arch,
    )  # fmt: skip
    ptx = kernel.asm["ptx"].splitlines()
    memory = [i for i, line in enumerate(ptx) if re.search(r"\b(ld|st)\.global", line)]
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    lets = [
        i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line
    ]
    if not pdl:
        assert not waits and not lets
        return
    assert len(waits) == 1 and waits[0] < memory[0], (
        f"first global access at PTX line {memory[0]}, the wait at {waits}"
    )
    assert len(lets) == 1, "stage 1 does not let the merge's launch begin"


class _Launches:
    """Stands in for a kernel: ``kernel[grid](...)`` records the launch's
    keyword arguments and runs nothing."""

    def __init__(self):
        self.kwargs: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "sm89"])
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_a_kernel_launched_before_the_one_ahead_ends_waits_for_it(
    monkeypatch, sm90, gluon
):
    """From sm_90 the Gluon stage 1 and the merge are launched
    programmatically: each is placed while the kernel before it drains.
    Only kernels that wait for it (``PDL``) may be launched so; the Triton
    stage 1 does not wait, so it is launched in order, and the query
    rotation's kernel as well."""
    from vllm.v1.attention.ops import triton_turboquant_rotate_query as rotation_mod

    rotation, stage1, merge = _Launches(), _Launches(), _Launches()
    monkeypatch.setattr(splitkv, "programmatic_launch", lambda device: sm90)
    monkeypatch.setattr(gluon_decode, "programmatic_launch", lambda device: sm90)
    monkeypatch.setattr(rotation_mod, "_tq_rotate_query", rotation)
    monkeypatch.setattr(gluon_decode, "_stage1", stage1)
    monkeypatch.setattr(splitkv, "_tq_decode_split_stage1", stage1)
    monkeypatch.setattr(splitkv, "_tq_decode_split_merge", merge)
    monkeypatch.setattr(
        tq_decode, "gluon_stage1", lambda d: gluon_decode if gluon else None
    )
    monkeypatch.setattr(gluon_decode, "_tables", {})
    cfg, centroids, pit, cache, table = packed_case(
        "turboquant_4bit_nc", 128, [40, 40], 2, "cpu"
    )
    decode(
        torch.randn(2, 8, 128), cache, table,
        torch.tensor([40, 40], dtype=torch.int32), cfg, centroids, pit,
        num_splits=3, hadamard_query=True,
    )  # fmt: skip
    assert len(rotation.kwargs) == len(stage1.kwargs) == len(merge.kwargs) == 1
    assert not rotation.kwargs[0].get("launch_pdl", False)
    assert merge.kwargs[0]["PDL"] is sm90
    assert merge.kwargs[0].get("launch_pdl", False) is sm90
    if gluon:
        assert stage1.kwargs[0]["PDL"] is sm90
        assert stage1.kwargs[0]["launch_pdl"] is sm90
    else:
        assert not stage1.kwargs[0].get("launch_pdl", False)


@pytest.mark.parametrize(
    ("platform", "capability", "gluon", "pdl"),
    [
        ("cuda", (9, 0), True, True),  # H100
        ("cuda", (8, 9), True, False),  # L4, RTX 4090
        ("cuda", (8, 6), False, False),  # A10, RTX 3090
        ("rocm", (9, 4), False, False),  # MI300X (gfx942)
        ("rocm", (9, 0), False, False),  # MI250 (gfx90a)
    ],
)
def test_nvidia_only_paths_are_chosen_on_nvidia_gpus_only(
    monkeypatch, platform, capability, gluon, pdl
):
    """ROCm reports its GPUs as "cuda" devices with capabilities such as 9.0
    and 9.4, and 0.20.2 lists TurboQuant among ROCm's backends. The Gluon
    stage 1 (PTX inline assembly, mma_v2) and programmatic launches
    (``griddepcontrol``) exist on NVIDIA GPUs only: chosen on ROCm, the first
    decode fails to compile."""
    monkeypatch.setattr(
        turboquant_device,
        "current_platform",
        SimpleNamespace(is_cuda=lambda: platform == "cuda"),
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    # Fresh caches, put back afterwards: the stand-in GPU must not outlive the test.
    monkeypatch.setattr(
        turboquant_device,
        "_capability",
        functools.cache(turboquant_device._capability.__wrapped__),
    )
    monkeypatch.setattr(
        tq_decode, "gluon_stage1", functools.cache(tq_decode.gluon_stage1.__wrapped__)
    )
    device = torch.device("cuda", 0)
    assert (tq_decode.gluon_stage1(device) is not None) is gluon
    assert turboquant_device.programmatic_launch(device) is pdl


def _spy_gluon_stage1(monkeypatch, argument: str) -> list:
    """The Gluon stage 1 chosen and watched: the list gets ``argument``'s value
    at each launch. No plans are remembered: one made for the same addresses
    by an earlier test would replay its launches without calling stage1."""
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "gluon")
    monkeypatch.setattr(tq_decode, "_plans", {})
    launched = []
    real = gluon_decode.stage1
    monkeypatch.setattr(
        gluon_decode,
        "stage1",
        lambda *a, **k: launched.append(k[argument]) or real(*a, **k),
    )
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("levels", ["solver", "fp16"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "shape",
    [(32, 8, 128, [1, 700, 8192, 0]), (24, 4, 256, [33, 8192, 0])],
    ids=["qwen3-4b", "qwen3.6-27b"],
)
def test_gluon_and_triton_stage1_agree_gpu(monkeypatch, preset, shape, levels):
    """With the Gluon stage 1 enabled, decode_attention takes it on sm_89+;
    the Triton one gives the same output, and both hold fp32 rounding against
    float64: for the solver's centroids (the key tails' dot) and for fp16
    ones, as layers hold them (one dot)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Gluon stage 1 needs sm_89+")
    Hq, Hk, D, seq_lens = shape
    device = "cuda"
    torch.manual_seed(11)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    if levels == "fp16":
        if cfg.key_fp8:
            pytest.skip("FP8 keys have no centroids")
        _fp16_levels(monkeypatch)
    centroids, midpoints, pit = tables(cfg, D, device)
    cache, table = stored_cache(cfg, seq_lens, Hk, D, device, pit, midpoints)
    query = torch.randn(len(seq_lens), Hq, D, device=device)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    B = len(seq_lens)
    launched = _spy_gluon_stage1(monkeypatch, "key_tails")

    def decoded():
        return (
            decode(
                query,
                cache,
                table,
                seq_t,
                cfg,
                centroids,
                pit,
                mid_o_buf=poisoned((B, Hq, 32, D + 1), device),
                output_buf=poisoned((B, Hq, D), device),
                num_splits=8,  # one count for both stage 1s
            )
            .double()
            .cpu()
        )

    got = decoded()
    assert launched, "decode_attention did not take the Gluon stage 1"
    assert launched[0] == (levels == "solver" and not cfg.key_fp8)
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "triton")
    triton_out = decoded()
    ref = reference_attention(
        query, cache, table, seq_lens, cfg, centroids, pit, D**-0.5
    )
    for out in (got, triton_out):
        assert not out.isnan().any()
        err = (out - ref).abs().max().item() / ref.abs().max().item()
        assert err < TOL, f"max error {err:.3g} relative to max |out|"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        (32, 8, 128, [1, 700, 8192, 0]),
        (24, 4, 256, [33, 8192, 0]),
        (16, 2, 512, [2100]),
    ],
    ids=["qwen3-4b", "qwen3.6-27b", "d512"],
)
def test_pair_codes_take_the_gluon_stage1_gpu(monkeypatch, shape):
    """Keys coded by pairs: decode_attention takes the Gluon stage 1 with the
    pair table on sm_89+, and it and the Triton stage 1 hold fp32 rounding
    against float64 over the same pair-coded slots."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Gluon stage 1 needs sm_89+")
    Hq, Hk, D, seq_lens = shape
    device = "cuda"
    torch.manual_seed(13)
    cfg, points, pit, cache, table = packed_case(
        "turboquant_3bit_nc", D, seq_lens, Hk, device, pairs=True
    )
    query = torch.randn(len(seq_lens), Hq, D, device=device)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    B = len(seq_lens)
    launched = _spy_gluon_stage1(monkeypatch, "key_pairs")

    def decoded():
        out = decode(
            query, cache, table, seq_t, cfg, points, pit,
            mid_o_buf=poisoned((B, Hq, 32, D + 1), device),
            output_buf=poisoned((B, Hq, D), device),
            num_splits=8,  # one count for both stage 1s
        )  # fmt: skip
        return out.double().cpu()

    got = decoded()
    assert launched == [True], "decode_attention did not take the Gluon pair path"
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "triton")
    triton_out = decoded()
    ref = reference_attention(query, cache, table, seq_lens, cfg, points, pit, D**-0.5)
    for out in (got, triton_out):
        assert not out.isnan().any()
        err = (out - ref).abs().max().item() / ref.abs().max().item()
        assert err < TOL, f"max error {err:.3g} relative to max |out|"


@pytest.mark.gpu
def test_one_row_splits_past_the_scratch_row_gpu(monkeypatch):
    """One 20K-token row on the Qwen3-4B shape, with the backend's scratch
    (32 splits per row for 64 rows): the default split count is past 32 and
    the output holds fp32 rounding against float64."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Gluon stage 1 needs sm_89+")
    Hq, Hk, D, device = 32, 8, 128, "cuda"
    torch.manual_seed(12)
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", D)
    centroids, midpoints, pit = tables(cfg, D, device)
    cache, table = stored_cache(cfg, [20000], Hk, D, device, pit, midpoints)
    query = torch.randn(1, Hq, D, device=device)
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "gluon")
    splits = []
    real = gluon_decode.stage1
    signature = inspect.signature(real)

    def counted(*args, **kwargs):
        # By name, whether the caller passes it by position or by keyword.
        splits.append(signature.bind(*args, **kwargs).arguments["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_decode, "stage1", counted)
    out = decode(
        query,
        cache,
        table,
        torch.tensor([20000], dtype=torch.int32, device=device),
        cfg,
        centroids,
        pit,
        mid_o_buf=poisoned((64, Hq, 32, D + 1), device),
    )
    assert splits and splits[0] > 32, splits
    ref = reference_attention(
        query, cache, table, [20000], cfg, centroids, pit, D**-0.5
    )
    got = out.double().cpu()
    assert not got.isnan().any()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, f"max error {err:.3g} relative to max |out|"
