# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant serves speculative verify rows as decode rows over its cache.

With speculation, a uniform batch of 1 + k tokens per request is captured as a
FULL CUDA graph. Pristine 0.20.2 sent such a batch down the prefill path,
which syncs with the host (``.tolist()``) and picks its kernels from capture-
time values; newer vLLM captures a FlashAttention over the k + 1 new tokens
only. These tests drive the real metadata builder and ``forward`` with the
kernels replaced by recorders: the captured path must be the decode kernel
over the KV cache for every query row, reading per-row lengths from buffers
that the builder rewrites in place for each replay.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionImpl,
    TurboQuantMetadataBuilder,
)

pytestmark = pytest.mark.cpu_test

HQ, HK, D, BLOCK, WIDTH = 4, 2, 64, 16, 16


def _vllm_config(num_spec: int | None, tree: str | None = None, max_num_seqs=8):
    spec = None
    if num_spec is not None:
        spec = SimpleNamespace(
            num_speculative_tokens=num_spec,
            parallel_drafting=False,
            speculative_token_tree=tree,
        )
    return SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
    )


def _builder(num_spec: int | None, tree: str | None = None):
    return TurboQuantMetadataBuilder(
        kv_cache_spec=None,
        layer_names=["model.layers.3.self_attn.attn"],
        vllm_config=_vllm_config(num_spec, tree),
        device=torch.device("cpu"),
    )


class Runner:
    """The runner's persistent metadata tensors, updated in place per step."""

    def __init__(self, max_reqs: int = 8, device: str = "cpu", width: int = WIDTH):
        self.qsl_cpu = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.qsl = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            max_reqs, width, dtype=torch.int32, device=device
        )
        self.slot_mapping = torch.zeros(64, dtype=torch.int64, device=device)

    def step(
        self,
        q_lens,
        seq_lens,
        num_tokens=None,
        prefilling=None,
        tables=None,
        max_seq_len=None,
    ):
        n = len(q_lens)
        cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
        self.qsl_cpu[: n + 1] = cu
        self.qsl_cpu[n + 1 :] = cu[-1]
        self.qsl.copy_(self.qsl_cpu)
        self.seq_lens[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens[n:] = 0
        width = self.block_table.shape[1]
        for i, row in enumerate(
            tables or [[10 * (i + 1) + j for j in range(width)] for i in range(n)]
        ):
            self.block_table[i] = torch.tensor(row, dtype=torch.int32)
        num_tokens = num_tokens or int(cu[-1])
        return CommonAttentionMetadata(
            query_start_loc=self.qsl[: n + 1],
            query_start_loc_cpu=self.qsl_cpu[: n + 1],
            seq_lens=self.seq_lens[:n],
            num_reqs=n,
            num_actual_tokens=num_tokens,
            max_query_len=max(q_lens),
            max_seq_len=max_seq_len or max(seq_lens),
            block_table_tensor=self.block_table[:n],
            slot_mapping=self.slot_mapping[:num_tokens],
            is_prefilling=torch.tensor(prefilling or [False] * n),
        )


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Device-to-host reads are illegal while a CUDA graph is captured, and
    would read capture-time values into a graph that is replayed later."""

    def refuse(self, *a, **k):
        raise AssertionError(
            "host sync (.tolist()/.item()) in the captured attention path"
        )

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", refuse)
        m.setattr(torch.Tensor, "item", refuse)
        yield


def _expected_rows(q_lens, seq_lens):
    return [s - q + 1 + j for q, s in zip(q_lens, seq_lens) for j in range(q)]


def test_speculative_verify_rows_are_decode_rows():
    builder = _builder(num_spec=3)
    assert builder.reorder_batch_threshold == 4
    cam = Runner().step([4, 4], [100, 200])
    meta = builder.build(0, cam)
    assert not meta.is_prefill
    assert (meta.num_decodes, meta.num_decode_tokens) == (2, 8)
    assert meta.decode_seq_lens.tolist() == _expected_rows([4, 4], [100, 200])
    assert meta.decode_block_table[:, 0].tolist() == [10] * 4 + [20] * 4


def test_without_speculation_the_decode_path_is_unchanged():
    builder = _builder(num_spec=None)
    assert builder.reorder_batch_threshold == 1
    meta = builder.build(0, Runner().step([1, 1, 5], [30, 40, 5]))
    assert getattr(meta, "decode_seq_lens", None) is None
    assert (meta.num_decodes, meta.num_decode_tokens, meta.is_prefill) == (2, 2, True)


class Recorder:
    def __init__(self):
        self.decode_calls: list[dict] = []
        self.flash_calls = 0

    def decode(self, query, kv_cache, block_table, seq_lens, **kwargs):
        self.decode_calls.append(
            dict(rows=query.shape[0], block_table=block_table, seq_lens=seq_lens)
        )
        return torch.zeros_like(query)

    def flash(self, *args, **kwargs):
        self.flash_calls += 1
        return torch.zeros_like(kwargs.get("q", args[0] if args else None))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(
        turboquant_attn, "triton_turboquant_decode_attention", rec.decode
    )
    monkeypatch.setattr(turboquant_attn, "_HAS_FLASH_ATTN", True)
    monkeypatch.setattr(
        turboquant_attn, "flash_attn_varlen_func", rec.flash, raising=False
    )
    monkeypatch.setattr(
        TurboQuantAttentionImpl,
        "_flash_attn_varlen",
        lambda self, **kw: rec.flash(**kw),
    )
    return rec


def _impl():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(
            num_heads=HQ,
            head_size=D,
            scale=D**-0.5,
            num_kv_heads=HK,
            kv_cache_dtype="turboquant_4bit_nc",
        )
    layer = torch.nn.Module()
    layer._tq_centroids = torch.linspace(-1, 1, 16)
    return impl, layer


def test_capture_of_a_uniform_verify_batch_reads_the_cache_for_every_row(
    recorder, monkeypatch
):
    """The graph recorded at capture is what every replay runs (issue #40880)."""
    builder = _builder(num_spec=3)
    runner = Runner()
    # Capture: the runner's dummy batch has seq_len == query_len == 1 + k and
    # max_seq_len == max_model_len.
    capture_meta = builder.build_for_cudagraph_capture(
        runner.step([4, 4], [4, 4], max_seq_len=4096)
    )
    impl, layer = _impl()
    n = 8
    q = torch.randn(n, HQ * D)
    kv = torch.randn(n, HK * D)

    with no_host_sync(monkeypatch):
        impl.forward(
            layer,
            q,
            kv,
            kv,
            torch.zeros(1, BLOCK, HK, 8, dtype=torch.uint8),
            capture_meta,
            output=torch.empty(n, HQ * D),
        )

    assert recorder.flash_calls == 0, "captured a prefill over the new tokens only"
    assert len(recorder.decode_calls) == 1
    call = recorder.decode_calls[0]
    assert call["rows"] == n

    # Replay: the runner rewrites its tensors in place and the builder runs
    # again; the captured kernel reads the same storage.
    builder.build(0, runner.step([4, 4], [100, 200], tables=[[7] * WIDTH, [9] * WIDTH]))
    assert call["seq_lens"].tolist() == _expected_rows([4, 4], [100, 200])
    assert call["block_table"][:, 0].tolist() == [7] * 4 + [9] * 4


def test_padded_graph_batch_and_stale_prefilling_slots():
    builder = _builder(num_spec=3)
    # Two real requests, two zero-length padding requests, tokens padded to 16;
    # the padding slots hold a stale is_prefilling=True from earlier requests.
    cam = Runner().step(
        [4, 4, 0, 0],
        [50, 60, 0, 0],
        num_tokens=16,
        prefilling=[False, False, True, True],
    )
    meta = builder.build(0, cam)
    assert not meta.is_prefill and meta.num_decode_tokens == 16
    assert meta.decode_seq_lens.tolist() == _expected_rows([4, 4], [50, 60]) + [0] * 8


def test_short_prefills_stay_prefill_rows():
    """A first chunk of <= 1 + k tokens keeps the prefill path (raw K/V), as it
    has without speculation; only rows done prefilling are decode rows."""
    builder = _builder(num_spec=3)
    cam = Runner().step([1, 4, 3], [20, 40, 3], prefilling=[False, False, True])
    meta = builder.build(0, cam)
    assert (meta.num_decodes, meta.num_decode_tokens, meta.is_prefill) == (2, 5, True)
    assert meta.decode_seq_lens.tolist() == [20, 37, 38, 39, 40]


def test_mixed_eager_batch_computes_both_parts(recorder):
    builder = _builder(num_spec=3)
    meta = builder.build(0, Runner().step([4, 6], [30, 6], prefilling=[False, True]))
    impl, layer = _impl()
    q, kv = torch.randn(10, HQ * D), torch.randn(10, HK * D)
    impl.forward(
        layer,
        q,
        kv,
        kv,
        torch.zeros(1, BLOCK, HK, 8, dtype=torch.uint8),
        meta,
        output=torch.empty(10, HQ * D),
    )
    assert recorder.decode_calls[0]["rows"] == 4
    assert recorder.decode_calls[0]["seq_lens"].tolist() == [27, 28, 29, 30]
    assert recorder.flash_calls == 1  # the 6-token first chunk, on raw K/V


def test_tree_speculation_is_refused_at_start_up():
    from vllm.v1.attention.backends.turboquant_verify_rows import (
        TurboQuantSpecConfigError,
    )

    with pytest.raises(TurboQuantSpecConfigError, match="TURBOQUANT.*tree mask"):
        _builder(num_spec=3, tree="[(0,), (1,), (0, 0)]")
    # A chain written as a tree is a chain.
    _builder(num_spec=2, tree="[(0,), (0, 0)]")
