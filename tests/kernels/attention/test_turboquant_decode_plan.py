# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A TurboQuant decode call seen before sends the launches it planned, and
they are the launches the call would make without a plan.

On CPU the kernels are real ``JITFunction``s and every ``CompiledLaunch``
takes its direct path to a stand-in compiled kernel that records what it
is sent (the decode's Python runs as on a GPU host, nothing is launched).
On a GPU the planned decode's outputs are compared with the unplanned
one's, bit for bit.
"""

import types

import pytest
import torch
from triton.runtime.jit import JITFunction

from tests.kernels.attention.turboquant_packed import decode, packed_case
from vllm.triton_utils import compiled_launch
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops import gluon_turboquant_decode as gluon
from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as triton_stage1
from vllm.v1.attention.ops import turboquant_decode as tq_decode

HQ, HK, D = 8, 2, 64


class _Sent(list):
    """A compiled kernel stand-in: ``run`` records its arguments."""

    function = "fn"
    packed_metadata = "meta"

    def run(self, *args):
        self.append(args)


@pytest.fixture
def sent(monkeypatch):
    """Every launch goes out directly to one recording stand-in."""
    if not isinstance(triton_stage1._tq_decode_split_stage1, JITFunction):
        pytest.skip("the kernels are the Triton interpreter's: nothing is compiled")
    compiled = _Sent()
    driver = types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 7
    )
    monkeypatch.setattr(compiled_launch, "driver", types.SimpleNamespace(active=driver))
    monkeypatch.setattr(compiled_launch, "_launchers", {})

    class Hits(dict):
        def get(self, key, default=None):
            return compiled, ()

    init = compiled_launch.CompiledLaunch.__init__

    def direct(self, kernel, enabled=None):
        init(self, kernel, True)
        self._by_args = Hits()

    monkeypatch.setattr(compiled_launch.CompiledLaunch, "__init__", direct)
    monkeypatch.setattr(tq_decode, "_plans", {})
    return compiled


def _case(preset, rows, stage, seed=0):
    """The tensors of one decode call; the cache, rotation and centroids are
    the same objects for every ``seed``, the per-call tensors new ones."""
    key = (preset, rows)
    if key not in _CASES:
        cfg, centroids, _, cache, table = packed_case(preset, D, [40] * rows, HK, "cpu")
        pit = _build_hadamard(D, "cpu")
        _CASES[key] = cfg, centroids, pit, cache, table
    cfg, centroids, pit, cache, table = _CASES[key]
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, HQ, D, generator=g).to(torch.bfloat16)
    seq = torch.randint(1, 41, (rows,), generator=g, dtype=torch.int32)
    return dict(
        query=query,
        cache=cache,
        table=table.clone(),
        seq_t=seq,
        cfg=cfg,
        centroids=centroids,
        pit=pit,
        stage=stage,
        hadamard_query=not cfg.key_fp8,
        output_buf=torch.empty(rows + 3, HQ, D, dtype=torch.bfloat16),
    )


_CASES: dict = {}


def _call(case, **overrides):
    kwargs = dict(case, **overrides)
    return decode(
        kwargs.pop("query"),
        kwargs.pop("cache"),
        kwargs.pop("table"),
        kwargs.pop("seq_t"),
        kwargs.pop("cfg"),
        kwargs.pop("centroids"),
        kwargs.pop("pit"),
        **kwargs,
    )


def _addresses(launches, known) -> list:
    """The launches with every tensor of ``known``'s as its address (a plan
    passes fixed tensors as addresses), and every other tensor (allocated
    by the call; two calls allocate at different addresses) named by its
    order of appearance."""
    names: dict[int, str] = {}
    out = []
    for args in launches:
        row = []
        for a in args:
            if isinstance(a, torch.Tensor):
                a = a.data_ptr()
                if a not in known:
                    a = names.setdefault(a, f"allocated {len(names)}")
            row.append(a)
        out.append(tuple(row))
    return out


def _known(case) -> set[int]:
    return {
        t.data_ptr()
        for t in (
            case["query"],
            case["cache"],
            case["table"],
            case["seq_t"],
            case["centroids"],
            case["pit"],
            case["output_buf"],
            case.get("mid_o_buf"),
            gluon.key_table(case["centroids"]),
        )
        if isinstance(t, torch.Tensor)
    }


def _unplanned(sent, monkeypatch, case, **overrides):
    """What ``case`` launches without a plan."""
    with monkeypatch.context() as m:
        m.setattr(tq_decode, "_plans", {})
        m.setattr(tq_decode, "MAX_PLANS", 0)
        sent.clear()
        _call(case, **overrides)
        return list(sent)


def _gluon_as_on_a_gpu(monkeypatch):
    """The Gluon stage 1's wrapper where a GPU would run it."""
    monkeypatch.setattr(tq_decode, "gluon_stage1", lambda device: gluon)
    monkeypatch.setattr(tq_decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(gluon, "resident_warps", lambda: 16)


@pytest.fixture(params=["gluon", "triton"])
def stage(request, monkeypatch):
    if request.param == "gluon":
        _gluon_as_on_a_gpu(monkeypatch)
    return request.param


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
@pytest.mark.parametrize("rows", [2, 300])
@pytest.mark.parametrize("buffers", ["caller's", "allocated"])
def test_a_planned_call_launches_what_an_unplanned_one_does(
    sent, monkeypatch, stage, preset, rows, buffers
):
    """Two splits and a merge (2 rows) and one split (300 rows), into the
    caller's output and scratch or into its own."""
    extra = {}
    if buffers == "caller's":
        extra["mid_o_buf"] = torch.empty(rows, HQ, 32, D + 1)
    else:
        extra["output_buf"] = None
    first = dict(_case(preset, rows, stage, seed=1), **extra)
    _call(first)
    assert len(tq_decode._plans) == 1, "the first call left no plan"
    second = dict(_case(preset, rows, stage, seed=2), **extra)
    sent.clear()
    out = _call(second)
    planned = list(sent)
    expect = _unplanned(sent, monkeypatch, second)
    known = _known(second)
    assert _addresses(planned, known) == _addresses(expect, known)
    assert len(tq_decode._plans) == 1, "the second call was not planned"
    assert out.shape == (rows, HQ, D)
    if buffers == "caller's":
        assert out.data_ptr() == second["output_buf"].data_ptr()


# One change at a time to what a decode call's launches depend on. With the
# change missing from the plan key, the changed call would send the first
# call's plan.
CHANGES = {
    "more rows": lambda c: dict(c, **_rows(c, 3)),
    "another scale": lambda c: dict(c, scale=0.5),
    "a strided query": lambda c: dict(
        c, query=torch.zeros(2, HQ + 4, D, dtype=torch.bfloat16)[:, :HQ]
    ),
    "an fp16 query": lambda c: dict(c, query=c["query"].half()),
    "a wider block table": lambda c: dict(
        c, table=torch.cat([c["table"], c["table"][:, :1]], 1)
    ),
    "an fp32 output": lambda c: dict(
        c, output_buf=torch.empty(5, HQ, D), out_dtype=torch.float32
    ),
    "another scratch": lambda c: dict(c, mid_o_buf=torch.empty(2, HQ, 4, D + 1)),
    "the cache moved": lambda c: dict(c, cache=c["cache"].clone()),
    "other centroids": lambda c: dict(c, centroids=c["centroids"].clone()),
    "the Triton stage 1": lambda c: dict(c, stage="triton"),
    "fewer splits": lambda c: dict(c, max_num_kv_splits=2, num_splits=None),
    "longer splits": lambda c: dict(c, min_split_tokens=64),
}


def _rows(case, rows):
    return dict(
        query=torch.randn(rows, HQ, D).to(torch.bfloat16),
        table=torch.cat([case["table"], case["table"][:1]]),
        seq_t=torch.cat([case["seq_t"], case["seq_t"][:1]]),
    )


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_part_of_the_key_changed_alone_is_a_new_plan(sent, monkeypatch, change):
    _gluon_as_on_a_gpu(monkeypatch)
    base = _case("turboquant_4bit_nc", 2, "gluon", seed=3)
    _call(base)
    _call(base)
    changed = CHANGES[change](base)
    sent.clear()
    _call(changed)
    seen = list(sent)
    expect = _unplanned(sent, monkeypatch, changed)
    known = _known(changed)
    assert _addresses(seen, known) == _addresses(expect, known)
    assert len(tq_decode._plans) == 2


@pytest.mark.parametrize(
    "what, case",
    [
        (
            "the query rotated by a matmul",
            lambda c: dict(c, pit=torch.linalg.qr(torch.randn(D, D))[0]),
        ),
        (
            "an FP8-key query copied to be contiguous",
            lambda c: dict(
                c, query=torch.zeros(2, HQ, 2 * D, dtype=torch.bfloat16)[..., ::2]
            ),
        ),
    ],
)
def test_a_call_that_computes_outside_its_launches_is_not_planned(sent, what, case):
    preset = "turboquant_k8v4" if "FP8" in what else "turboquant_4bit_nc"
    c = case(_case(preset, 2, "triton", seed=4))
    c["hadamard_query"] = "matmul" not in what and not c["cfg"].key_fp8
    _call(c)
    _call(c)
    assert tq_decode._plans == {}, what


def test_plans_are_bounded(sent, monkeypatch):
    monkeypatch.setattr(tq_decode, "MAX_PLANS", 2)
    for seed, rows in enumerate([2, 3, 4]):
        _call(_case("turboquant_k8v4", rows, "triton", seed=seed))
    assert len(tq_decode._plans) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
@pytest.mark.parametrize("rows", [2, 64, 512])
def test_a_planned_decode_computes_the_unplanned_bits(preset, rows, monkeypatch):
    """On the GPU: the second call (other query, lengths and block table,
    one plan) equals the same call without plans, and so does a CUDA graph
    captured through the plan and replayed."""
    monkeypatch.setattr(tq_decode, "_plans", {})
    Hq, Hk, D_ = 32, 8, 128
    cfg, centroids, _, cache, table = packed_case(preset, D_, [300] * rows, Hk, "cuda")
    pit = _build_hadamard(D_, "cuda")
    mid = torch.empty(rows, Hq, 32, D_ + 1, device="cuda")
    out = torch.empty(rows, Hq, D_, device="cuda", dtype=torch.bfloat16)

    def call(query, seq, tab):
        return decode(
            query, cache, tab, seq, cfg, centroids, pit, mid_o_buf=mid,
            output_buf=out, hadamard_query=not cfg.key_fp8,
        ).clone()  # fmt: skip

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(rows, Hq, D_, device="cuda", generator=g)
        seq = torch.randint(1, 301, (rows,), device="cuda", generator=g)
        return q.to(torch.bfloat16), seq.to(torch.int32), table.clone()

    call(*inputs(1))
    assert len(tq_decode._plans) == 1
    second = inputs(2)
    planned = call(*second)
    with monkeypatch.context() as m:
        m.setattr(tq_decode, "_plans", {})
        m.setattr(tq_decode, "MAX_PLANS", 0)
        unplanned = call(*second)
    assert torch.equal(planned, unplanned)
    assert not planned.isnan().any()

    q, seq, tab = inputs(3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode(
            q, cache, tab, seq, cfg, centroids, pit, mid_o_buf=mid,
            output_buf=out, hadamard_query=not cfg.key_fp8,
        )  # fmt: skip
    third = inputs(4)
    for t, new in zip((q, seq, tab), third):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    with monkeypatch.context() as m:
        m.setattr(tq_decode, "_plans", {})
        m.setattr(tq_decode, "MAX_PLANS", 0)
        assert torch.equal(captured.clone(), call(*third))
