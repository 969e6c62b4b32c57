# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GDN / Mamba2 state after a speculative step, at the metadata level.

After a speculative step accepts ``n`` tokens, a request's valid conv history
and SSM state sit at offset ``n - 1``; only the speculative path applies it.
Pristine 0.20.2 sends decode rows that got no drafts (ngram found no match) to
the non-speculative path (GDN), and passes no accepted counts at all on steps
where no request drafted (GDN and Mamba2), so their state is read at offset 0.

Real builder classes on CPU; the Mamba2 model config is a local tiny one.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

pytestmark = pytest.mark.cpu_test

NUM_SPEC = 3
BLOCK_SIZE = 16
DEVICE = torch.device("cpu")


def _vllm_config(num_spec: int = NUM_SPEC, model_config=None) -> VllmConfig:
    extra = {"model_config": model_config} if model_config is not None else {}
    config = VllmConfig(
        **extra,
        scheduler_config=SchedulerConfig(
            max_model_len=512,
            is_encoder_decoder=False,
            max_num_seqs=8,
            max_num_batched_tokens=512,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
    )
    if num_spec:
        config.speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=num_spec,
            prompt_lookup_max=3,
            prompt_lookup_min=2,
        )
    # The CPU platform turns CUDA graphs off; the builders' FULL-graph buffers
    # are what replay reads, so exercise them.
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    return config


def _mamba_spec(num_spec: int = NUM_SPEC) -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((64, 3 + num_spec), (2, 16, 16)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=num_spec,
    )


def _gdn_builder(num_spec: int = NUM_SPEC) -> GDNAttentionMetadataBuilder:
    return GDNAttentionMetadataBuilder(
        _mamba_spec(num_spec),
        ["model.layers.0.linear_attn"],
        _vllm_config(num_spec),
        DEVICE,
    )


@pytest.fixture(scope="module")
def mamba2_model_config(tmp_path_factory) -> ModelConfig:
    path = tmp_path_factory.mktemp("tiny_mamba2")
    config = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 64,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=str(path),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
    )


def _mamba2_builder(model_config: ModelConfig) -> Mamba2AttentionMetadataBuilder:
    return Mamba2AttentionMetadataBuilder(
        _mamba_spec(),
        ["backbone.layers.0.mixer"],
        _vllm_config(model_config=model_config),
        DEVICE,
    )


def _common(
    query_lens: list[int],
    num_computed: list[int],
    num_prompt: list[int] | None = None,
) -> CommonAttentionMetadata:
    """One batch; request ``i`` owns state blocks ``10*(i+1) .. 10*(i+1)+NUM_SPEC``."""
    num_reqs = len(query_lens)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    computed = torch.tensor(num_computed, dtype=torch.int32)
    seq_lens = computed + torch.tensor(query_lens, dtype=torch.int32)
    prompt = torch.tensor(num_prompt if num_prompt else num_computed, dtype=torch.int32)
    block_table = torch.tensor(
        [[10 * (i + 1) + j for j in range(NUM_SPEC + 1)] for i in range(num_reqs)],
        dtype=torch.int32,
    )
    num_tokens = int(query_start_loc[-1])
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        is_prefilling=computed < prompt,
        _seq_lens_cpu=seq_lens,
        _num_computed_tokens_cpu=computed,
    )


def _shim_triton_cdiv(monkeypatch) -> None:
    """Prefill rows make the GDN builder precompute FLA chunk indices with
    ``triton.cdiv``; without a GPU (and outside the interpreter) vLLM's
    ``triton`` is a placeholder."""
    from vllm.model_executor.layers.fla.ops import index

    if not hasattr(index.triton, "cdiv"):
        monkeypatch.setattr(
            index, "triton", SimpleNamespace(cdiv=lambda a, b: (a + b - 1) // b)
        )


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------
# GDN builder


def test_gdn_zero_draft_rows_keep_the_accepted_offset():
    """Two decode rows that got no drafts, after accepting 3 and 1 tokens."""
    meta = _gdn_builder().build(
        0,
        _common([1, 1], [40, 20]),
        num_accepted_tokens=_i32([3, 1]),
        num_decode_draft_tokens_cpu=_i32([0, 0]),
    )
    print(meta.num_spec_decodes, meta.num_decodes, meta.num_accepted_tokens)
    assert meta.num_spec_decodes == 2 and meta.num_decodes == 0
    assert meta.num_accepted_tokens.tolist() == [3, 1]
    assert meta.spec_state_indices_tensor[:, 0].tolist() == [10, 20]
    assert meta.non_spec_state_indices_tensor is None


def test_gdn_zero_draft_row_beside_drafted_row_and_prefill_tail(monkeypatch):
    """A drafted row, a zero-draft row and a one-token chunked-prefill tail:
    the tail keeps the prefill path (offset 0, with its initial state).
    Control: 0.20.2's builder already handles a 0 beside drafted rows (its
    runner never sends one); this guards against over-marking tails."""
    _shim_triton_cdiv(monkeypatch)
    meta = _gdn_builder().build(
        0,
        _common([4, 1, 1], [30, 40, 15], num_prompt=[30, 40, 16]),
        num_accepted_tokens=_i32([2, 4, 1]),
        num_decode_draft_tokens_cpu=_i32([3, 0, -1]),
    )
    assert meta.num_spec_decodes == 2
    assert meta.num_accepted_tokens.tolist() == [2, 4]
    assert meta.spec_sequence_masks.tolist() == [True, True, False]
    assert meta.num_prefills == 1 and meta.num_prefill_tokens == 1
    assert meta.non_spec_state_indices_tensor.tolist() == [30]
    assert meta.has_initial_state.tolist() == [True]


def test_gdn_q_len_1_capture_routes_like_runtime_zero_draft_rows():
    """FULL-graph capture of a q_len=1 batch must record the path that a
    runtime batch of zero-draft rows takes, or replay reads stale buffers."""
    builder = _gdn_builder()
    capture = builder.build_for_cudagraph_capture(_common([1, 1, 1], [5, 5, 5]))
    runtime = builder.build(
        0,
        _common([1, 1, 1], [40, 20, 9]),
        num_accepted_tokens=_i32([3, 1, 2]),
        num_decode_draft_tokens_cpu=_i32([0, 0, 0]),
    )
    for meta in (capture, runtime):
        assert meta.num_spec_decodes == 3 and meta.num_decodes == 0
    # Runtime values land in the persistent buffers the captured graph reads.
    assert runtime.num_accepted_tokens.data_ptr() == (
        builder.num_accepted_tokens.data_ptr()
    )
    assert runtime.spec_state_indices_tensor.data_ptr() == (
        builder.spec_state_indices_tensor.data_ptr()
    )


def test_gdn_without_speculative_config_keeps_plain_decode():
    meta = _gdn_builder(num_spec=0).build(0, _common([1, 1], [40, 20]))
    assert meta.num_decodes == 2 and meta.num_spec_decodes == 0
    assert meta.num_accepted_tokens is None


# ---------------------------------------------------------------------------
# Mamba2 builder


def test_mamba2_resumed_recompute_chunk_takes_the_prefill_path(mamba2_model_config):
    """A zero-draft decode row reads its accepted offset; the 3-token
    recompute chunk of a preempted request that has passed its prompt (no
    drafts, after the decode rows) takes the prefill path: the decode kernels
    keep one state per token and the next step would read the first one."""
    meta = _mamba2_builder(mamba2_model_config).build(
        0,
        _common([1, 3], [40, 25], num_prompt=[40, 20]),
        num_accepted_tokens=_i32([3, 1]),
        num_decode_draft_tokens_cpu=_i32([0, -1]),
    )
    assert meta.num_decodes == 1 and meta.num_prefills == 1
    assert meta.num_accepted_tokens.tolist() == [3]
    assert meta.state_indices_tensor_p.tolist() == [20]
    assert meta.has_initial_states_p.tolist() == [True]


def test_mamba2_zero_draft_decode_keeps_the_accepted_offset(mamba2_model_config):
    """Control: given the counts, 0.20.2's Mamba2 builder applies them; its
    runner is what drops them (test_runner_passes_accepted_counts_...)."""
    meta = _mamba2_builder(mamba2_model_config).build(
        0,
        _common([1, 1], [40, 20]),
        num_accepted_tokens=_i32([3, 2]),
        num_decode_draft_tokens_cpu=_i32([0, 0]),
    )
    assert meta.num_decodes == 2
    assert meta.num_accepted_tokens.tolist() == [3, 2]
    assert meta.query_start_loc_d.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------
# Runner: which rows are speculative rows, their order, and what the builders
# get on a step where no request drafted.


class _Batch:
    """The slice of ``InputBatch`` that reordering and draft counts read."""

    def __init__(self, rows: list[tuple[str, int, int]]):
        self.req_ids = [r[0] for r in rows]
        self.num_computed_tokens_cpu = np.array([r[1] for r in rows], dtype=np.int32)
        self.num_prompt_tokens = np.array([r[2] for r in rows], dtype=np.int32)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def swap_states(self, i: int, j: int) -> None:
        for arr in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
            arr[i], arr[j] = arr[j], arr[i]


def _sched(num_scheduled: dict[str, int], drafts: dict[str, list[int]]):
    return SimpleNamespace(
        num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=drafts
    )


# (req_id, num_computed, num_prompt), num_scheduled, drafts
_STEP_ROWS = [
    ("resumed", 30, 20),  # recompute chunk past its prompt, 3 tokens, no drafts
    ("nomatch", 40, 10),  # decode, ngram found no match
    ("drafted", 50, 10),  # decode with 3 drafts
    ("tail", 15, 16),  # one-token chunked-prefill tail
    ("resumed_last", 35, 20),  # final one-token recompute chunk
]
_SCHEDULED = {"resumed": 3, "nomatch": 1, "drafted": 4, "tail": 1, "resumed_last": 1}


def test_draft_counts_mark_zero_draft_decode_rows_only():
    from vllm.v1.attention.backends.mamba_spec_rows import spec_row_draft_counts

    counts = spec_row_draft_counts(
        np.array([_SCHEDULED[r[0]] for r in _STEP_ROWS]),
        np.array([3 if r[0] == "drafted" else 0 for r in _STEP_ROWS]),
        np.array([r[1] for r in _STEP_ROWS]),
        np.array([r[2] for r in _STEP_ROWS]),
    )
    assert counts.tolist() == [-1, 0, 3, -1, 0]


def _runner_stub(batch: _Batch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.kv_cache_config = SimpleNamespace(
        kv_cache_groups=[object()], has_mamba_layers=True
    )
    runner.reorder_batch_threshold = 1 + NUM_SPEC
    runner.speculative_config = SimpleNamespace(num_speculative_tokens=NUM_SPEC)
    runner.input_batch = batch
    return runner


def test_runner_reorder_puts_speculative_rows_first():
    """The GDN speculative kernels read gating inputs at the speculative rows'
    own token offsets, and the Mamba2 builder splits at the first prefill-type
    row: speculative rows must lead the batch."""
    batch = _Batch(list(_STEP_ROWS))
    runner = _runner_stub(batch)
    runner._may_reorder_batch(_sched(_SCHEDULED, {"drafted": [7, 8, 9]}))
    print(batch.req_ids)
    assert set(batch.req_ids[:3]) == {"nomatch", "drafted", "resumed_last"}
    assert batch.req_ids[3:] == ["resumed", "tail"]


class _Buffer:
    """``CpuGpuBuffer`` on a CPU-only box: one tensor for both sides."""

    def __init__(self, size: int, fill: int):
        self.cpu = torch.full((size,), fill, dtype=torch.int32)
        self.gpu = self.cpu
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        return self.gpu


class _BlockTable:
    def __init__(self, table: torch.Tensor):
        self.table = table

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.table[:num_reqs]


def _fill_draft_counts(runner, scheduler_output, num_scheduled_tokens) -> None:
    """What ``GPUModelRunner._prepare_inputs`` writes into
    ``num_decode_draft_tokens``; 0.20.2 writes nothing on a step without
    drafts (the buffer keeps the previous step's values)."""
    try:
        from vllm.v1.attention.backends.mamba_spec_rows import (
            fill_decode_draft_tokens,
        )
    except ImportError:
        return
    fill_decode_draft_tokens(
        runner.num_decode_draft_tokens,
        runner.input_batch,
        scheduler_output,
        num_scheduled_tokens,
    )


def _build_through_runner(runner, builders, common: CommonAttentionMetadata):
    """Run the real ``GPUModelRunner._build_attention_metadata`` for one KV
    cache group whose attention groups hold ``builders``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    num_reqs = common.num_reqs
    spec = builders[0].kv_cache_spec
    runner.kv_cache_config.kv_cache_groups = [SimpleNamespace(kv_cache_spec=spec)]
    runner.attn_groups = [
        [
            SimpleNamespace(
                get_metadata_builder=lambda ubid=0, b=b: b,
                layer_names=[f"layer.{i}"],
            )
            for i, b in enumerate(builders)
        ]
    ]
    batch = runner.input_batch
    batch.num_computed_tokens_cpu_tensor = torch.from_numpy(
        batch.num_computed_tokens_cpu
    )
    batch.num_prompt_tokens_cpu_tensor = torch.from_numpy(batch.num_prompt_tokens)
    batch.block_table = [_BlockTable(common.block_table_tensor)]
    runner.optimistic_seq_lens_cpu = common.seq_lens.clone()
    runner.query_start_loc = SimpleNamespace(
        gpu=common.query_start_loc, cpu=common.query_start_loc_cpu
    )
    runner.seq_lens = common.seq_lens
    runner.positions = torch.zeros(common.num_actual_tokens, dtype=torch.int64)
    runner.routed_experts_initialized = False
    runner.use_async_spec_decode = False
    runner.dcp_world_size = 1
    runner.cache_config = SimpleNamespace(kv_sharing_fast_prefill=False)
    runner.max_model_len = 512
    runner.drafter = None
    runner.is_mm_prefix_lm = False
    runner._get_encoder_seq_lens = lambda *args, **kwargs: (None, None)
    attn_metadata, _ = GPUModelRunner._build_attention_metadata(
        runner,
        num_tokens=common.num_actual_tokens,
        num_reqs=num_reqs,
        max_query_len=common.max_query_len,
        use_spec_decode=False,
        slot_mappings={0: common.slot_mapping},
    )
    return [attn_metadata[f"layer.{i}"] for i in range(len(builders))]


def test_runner_passes_accepted_counts_on_a_step_without_drafts(mamba2_model_config):
    """The step after a speculative step that accepted 3 and 2 tokens; ngram
    found nothing for either request, so no request drafted
    (``use_spec_decode`` is False). The GDN and Mamba2 builders must still
    get the accepted counts and apply them."""
    batch = _Batch([("a", 40, 10), ("b", 20, 10)])
    runner = _runner_stub(batch)
    runner.num_decode_draft_tokens = _Buffer(8, fill=-1)
    runner.num_accepted_tokens = _Buffer(8, fill=1)
    runner.num_accepted_tokens.np[:2] = [3, 2]
    _fill_draft_counts(
        runner, _sched({"a": 1, "b": 1}, {}), np.array([1, 1], dtype=np.int32)
    )

    gdn, mamba2 = _gdn_builder(), _mamba2_builder(mamba2_model_config)
    gdn_meta, mamba2_meta = _build_through_runner(
        runner, [gdn, mamba2], _common([1, 1], [40, 20], num_prompt=[10, 10])
    )
    print(gdn_meta.num_spec_decodes, gdn_meta.num_accepted_tokens)
    print(mamba2_meta.num_decodes, mamba2_meta.num_accepted_tokens)
    assert gdn_meta.num_spec_decodes == 2
    assert gdn_meta.num_accepted_tokens.tolist() == [3, 2]
    assert mamba2_meta.num_decodes == 2
    assert mamba2_meta.num_accepted_tokens.tolist() == [3, 2]


def test_dummy_runs_before_the_first_step_have_no_speculative_rows(monkeypatch):
    """Warm-up runs before FULL-graph capture pass the runner's buffers to the
    builders unfilled. Zero-filled, every row would be a speculative row with
    accepted count 0 (state offset -1)."""
    from vllm.v1.attention.backends.mamba_spec_rows import reset_spec_row_buffers

    _shim_triton_cdiv(monkeypatch)
    drafts, accepted = _Buffer(8, fill=0), _Buffer(8, fill=0)
    reset_spec_row_buffers(drafts, accepted)
    meta = _gdn_builder().build(
        0,
        _common([4, 4], [0, 0], num_prompt=[0, 0]),
        num_accepted_tokens=accepted.gpu[:2],
        num_decode_draft_tokens_cpu=drafts.cpu[:2],
    )
    assert meta.num_spec_decodes == 0
    assert accepted.cpu.tolist() == [1] * 8
