# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GDN conv + gated-delta-rule state across "accepted n, then no drafts".

Drives ``causal_conv1d_update`` and the GDN recurrent kernels through
``GatedDeltaNetAttention._forward_core`` (the real layer code, on a stub layer)
with the metadata the real ``GDNAttentionMetadataBuilder`` builds for three
steps of two requests:

1. a speculative step verifying 3 drafts each; request 0 accepts 3 tokens,
   request 1 accepts 2;
2. a step where ngram found no draft for either request (one token each);
3. a speculative step again (accepted count 1 after step 2).

Outputs are checked against a sequential float64 reference of the causal
conv and the gated delta rule over the accepted tokens only. On pristine
0.20.2, step 2 takes the non-speculative decode path and reads conv history
and SSM state at offset 0 (the state after the first verified token).

Triton interpreter (``HYBRIDKV_TRITON_INTERPRET=1``) on CPU, or natively on a
GPU (``triton_device``); fp32, tiny shapes.
"""

import functools
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from tests.v1.attention.test_mamba_spec_rows import _Batch, _runner_stub, _sched
from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MambaSpec

NUM_SPEC = 3
WIDTH = 4  # conv kernel
H, HV, K, V = 1, 2, 16, 16  # key heads, value heads, head dims
DIM = 2 * H * K + HV * V  # conv channels: q, k, v
NUM_BLOCKS = 48
PREFIX = 5  # tokens each request processed before step 1
ACCEPTED = [3, 2]  # step 1: tokens accepted per request (incl. the bonus)
LAYER = "model.layers.0.linear_attn"


def _builder(device: str):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_model_len=256,
            is_encoder_decoder=False,
            max_num_seqs=4,
            max_num_batched_tokens=256,
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=False),
    )
    config.speculative_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=NUM_SPEC,
        prompt_lookup_max=3,
        prompt_lookup_min=2,
    )
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    spec = MambaSpec(
        block_size=16,
        shapes=((DIM, WIDTH - 1 + NUM_SPEC), (HV, V, K)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=NUM_SPEC,
    )
    return GDNAttentionMetadataBuilder(spec, [LAYER], config, torch.device(device))


def _blocks(req: int) -> list[int]:
    return [10 * (req + 1) + j for j in range(NUM_SPEC + 1)]


def _common(
    query_lens: list[int], num_computed: list[int], device: str, reqs: list[int]
) -> CommonAttentionMetadata:
    """Row ``i`` is request ``reqs[i]`` (its state blocks)."""
    n = len(query_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    computed = torch.tensor(num_computed, dtype=torch.int32)
    seq_lens = computed + torch.tensor(query_lens, dtype=torch.int32)
    tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=n,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.tensor([_blocks(r) for r in reqs]).int().to(device),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        is_prefilling=torch.zeros(n, dtype=torch.bool),
        _seq_lens_cpu=seq_lens,
        _num_computed_tokens_cpu=computed,
    )


class _Reference:
    """Sequential float64 causal conv + gated delta rule for one request."""

    def __init__(self, p):
        self.p = p
        self.inputs: list[torch.Tensor] = []  # raw mixed_qkv rows
        self.h = torch.zeros(HV, V, K, dtype=torch.float64)

    def step(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p = self.p
        self.inputs.append(x.double())
        window = self.inputs[-WIDTH:]
        window = [torch.zeros(DIM, dtype=torch.float64)] * (
            WIDTH - len(window)
        ) + window
        conv = p["bias"].double() + (p["weight"].double() * torch.stack(window, 1)).sum(
            1
        )
        conv = F.silu(conv)
        q, k, v = conv.split([H * K, H * K, HV * V])
        q, k, v = q.view(H, K), k.view(H, K), v.view(HV, V)
        out = torch.empty(HV, V, dtype=torch.float64)
        for hv in range(HV):
            h = hv // (HV // H)
            qn = q[h] / torch.sqrt((q[h] * q[h]).sum() + 1e-6) * K**-0.5
            kn = k[h] / torch.sqrt((k[h] * k[h]).sum() + 1e-6)
            x_g = a[hv].double() + p["dt_bias"][hv].double()
            g = -torch.exp(p["A_log"][hv].double()) * F.softplus(x_g)
            beta = torch.sigmoid(b[hv].double())
            self.h[hv] *= torch.exp(g)
            delta = (v[hv] - self.h[hv] @ kn) * beta
            self.h[hv] += torch.outer(delta, kn)
            out[hv] = self.h[hv] @ qn
        return out


def _layer(params, conv_state, ssm_state):
    from vllm.model_executor.layers.mamba.gdn_linear_attn import (
        ChunkGatedDeltaRule,
        GatedDeltaNetAttention,
    )

    layer = SimpleNamespace(
        prefix=LAYER,
        kv_cache=(conv_state, ssm_state),
        conv1d=SimpleNamespace(
            weight=params["weight"].unsqueeze(1), bias=params["bias"]
        ),
        activation="silu",
        A_log=params["A_log"],
        dt_bias=params["dt_bias"],
        num_k_heads=H,
        tp_size=1,
        head_k_dim=K,
        head_v_dim=V,
        key_dim=H * K,
        value_dim=HV * V,
        # The packed non-spec decode kernel does not run under the Triton
        # interpreter; the other non-spec decode kernels read offset 0 alike.
        enable_packed_recurrent_decode=False,
        chunk_gated_delta_rule=functools.partial(
            ChunkGatedDeltaRule.forward_native, None
        ),
    )
    for name in ("rearrange_mixed_qkv", "_forward_core_decode_non_spec"):
        setattr(
            layer, name, functools.partial(getattr(GatedDeltaNetAttention, name), layer)
        )
    return layer, functools.partial(GatedDeltaNetAttention._forward_core, layer)


class _Rig:
    """State caches, the real builder, the stub layer and one float64
    reference per request."""

    def __init__(self, device: str, num_reqs: int, monkeypatch):
        from vllm.model_executor.layers.mamba.mamba_utils import (
            is_conv_state_dim_first,
        )

        torch.manual_seed(0)
        self.device = device
        self.monkeypatch = monkeypatch
        self.params = {
            "weight": torch.randn(DIM, WIDTH) * 0.5,
            "bias": torch.randn(DIM) * 0.1,
            "A_log": torch.randn(HV) * 0.5,
            "dt_bias": torch.randn(HV) * 0.5,
        }
        state_len = WIDTH - 1 + NUM_SPEC
        if is_conv_state_dim_first():
            self.conv_state = torch.zeros(NUM_BLOCKS, DIM, state_len, device=device)
            self.conv_ds = self.conv_state
        else:
            self.conv_state = torch.zeros(NUM_BLOCKS, state_len, DIM, device=device)
            self.conv_ds = self.conv_state.transpose(-1, -2)
        self.ssm_state = torch.zeros(NUM_BLOCKS, HV, V, K, device=device)
        self.layer, self.forward_core = _layer(
            {n: t.to(device) for n, t in self.params.items()},
            self.conv_state,
            self.ssm_state,
        )
        self.builder = _builder(device)
        self.refs = [_Reference(self.params) for _ in range(num_reqs)]

    def prefix(self, req: int, offset: int) -> None:
        """Process PREFIX tokens and leave the state where a step that
        accepted ``offset + 1`` tokens leaves it."""
        ref = self.refs[req]
        for _ in range(PREFIX):
            ref.step(torch.randn(DIM), torch.randn(HV), torch.randn(HV))
        history = torch.stack(ref.inputs[-(WIDTH - 1) :], 1).float()
        block = _blocks(req)
        self.conv_ds[block[0], :, offset : offset + WIDTH - 1] = history.to(self.device)
        self.ssm_state[block[offset]] = ref.h.float().to(self.device)

    def run(self, query_lens, num_computed, num_accepted, drafts, reqs=None):
        from vllm.model_executor.layers.mamba import gdn_linear_attn

        device = self.device
        meta = self.builder.build(
            0,
            _common(
                query_lens, num_computed, device, reqs or list(range(len(query_lens)))
            ),
            num_accepted_tokens=torch.tensor(
                num_accepted, dtype=torch.int32, device=device
            ),
            num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
        )
        tokens = sum(query_lens)
        x = torch.randn(tokens, DIM)
        a, b = torch.randn(tokens, HV), torch.randn(tokens, HV)
        out = torch.zeros(tokens, HV, V, device=device)
        self.monkeypatch.setattr(
            gdn_linear_attn,
            "get_forward_context",
            lambda: SimpleNamespace(attn_metadata={LAYER: meta}),
        )
        # The conv kernels overwrite their input.
        self.forward_core(
            x.to(device).clone(), b.to(device).clone(), a.to(device).clone(), out
        )
        return meta, (x, a, b, out.cpu())

    def check(self, step, rows, query_lens, keep, inputs) -> None:
        """Row ``i`` of the batch is request ``rows[i]``; compare its first
        ``keep[i]`` outputs and advance its reference by those tokens."""
        x, a, b, out = inputs
        start = 0
        for i, req in enumerate(rows):
            for t in range(keep[i]):
                j = start + t
                expected = self.refs[req].step(x[j], a[j], b[j])
                err = (out[j].double() - expected).abs().max().item()
                assert err < 1e-4, (
                    f"step {step}, request {req}, token {t}: max error {err:.3g}"
                )
            start += query_lens[i]


def test_zero_draft_step_after_accepted_drafts_matches_reference(
    triton_device, monkeypatch
):
    rig = _Rig(triton_device, 2, monkeypatch)
    for req in range(2):
        rig.prefix(req, offset=0)

    # Step 1: 3 drafts each, accepted count 1 from the prefill.
    _, inputs = rig.run([4, 4], [PREFIX, PREFIX], [1, 1], [3, 3])
    rig.check(1, [0, 1], [4, 4], ACCEPTED, inputs)

    # Step 2: no drafts; the previous step accepted 3 and 2 tokens.
    computed = [PREFIX + n for n in ACCEPTED]
    meta, inputs = rig.run([1, 1], computed, ACCEPTED, [0, 0])
    print(
        "step 2: num_spec_decodes",
        meta.num_spec_decodes,
        "num_decodes",
        meta.num_decodes,
        "num_accepted_tokens",
        meta.num_accepted_tokens,
    )
    rig.check(2, [0, 1], [1, 1], [1, 1], inputs)

    # Step 3: drafts again; step 2 accepted its one token.
    computed = [c + 1 for c in computed]
    _, inputs = rig.run([4, 4], computed, [1, 1], [3, 3])
    rig.check(3, [0, 1], [4, 4], [4, 4], inputs)


def _runner_rows(batch: _Batch, scheduled: dict[str, int], drafts: dict[str, list]):
    """Order and per-row draft counts as ``GPUModelRunner`` produces them."""
    runner = _runner_stub(batch)
    sched = _sched(scheduled, drafts)
    runner._may_reorder_batch(sched)
    num_scheduled = np.array([scheduled[r] for r in batch.req_ids])
    num_drafts = np.array([len(drafts.get(r, ())) for r in batch.req_ids])
    done = batch.num_computed_tokens_cpu >= batch.num_prompt_tokens
    try:
        from vllm.v1.attention.backends.mamba_spec_rows import spec_row_draft_counts
    except ImportError:
        # 0.20.2 (_prepare_inputs): drafted rows done with their prompt.
        counts = np.where(done & (num_drafts > 0), num_drafts, -1)
    else:
        counts = spec_row_draft_counts(
            num_scheduled,
            num_drafts,
            batch.num_computed_tokens_cpu,
            batch.num_prompt_tokens,
        )
    return list(batch.req_ids), num_scheduled.tolist(), counts.tolist()


def _torch_causal_conv1d_fn(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices=None,
    has_initial_state=None,
    activation=None,
    metadata=None,
    **kwargs,
):
    """Stand-in for the prefill ``causal_conv1d_fn`` under the interpreter: its
    launch grid fills ``batch_ptr`` from inside the grid callback, which the
    Triton interpreter does not carry into the kernel's arguments."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    for i in range(query_start_loc.numel() - 1):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        idx = int(cache_indices[i])
        history = conv_states[idx, :, : width - 1]
        if not bool(has_initial_state[i]):
            history = torch.zeros_like(history)
        full = torch.cat([history, x[:, start:end]], 1)
        for t in range(end - start):
            acc = (weight * full[:, t : t + width]).sum(1) + bias
            out[:, start + t] = F.silu(acc) if activation else acc
        conv_states[idx, :, : width - 1] = full[:, -(width - 1) :]
    return out


def _torch_chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, **kwargs
):
    """Stand-in for the FLA chunked prefill, which refuses fp32 (and bf16 is
    wrong under the interpreter); q and k arrive l2-normalised, g as log decay."""
    out = torch.empty_like(v)
    finals = []
    for i in range(cu_seqlens.numel() - 1):
        h = initial_state[i].clone()
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            for hv in range(HV):
                kh = k[0, t, hv // (HV // H)]
                h[hv] *= torch.exp(g[0, t, hv])
                delta = (v[0, t, hv] - h[hv] @ kh) * beta[0, t, hv]
                h[hv] += torch.outer(delta, kh)
                out[0, t, hv] = h[hv] @ (q[0, t, hv // (HV // H)] * K**-0.5)
        finals.append(h)
    return out, torch.stack(finals)


def test_mixed_spec_step_with_resumed_chunk_matches_reference(
    triton_device, monkeypatch
):
    """One step with three decode-region rows: the 2-token recompute chunk of
    a resumed request (past its prompt, no drafts; state at offset 0), a row
    verifying 3 drafts after accepting 2, and a row with no drafts after
    accepting 3. The speculative rows must read their accepted offsets and
    lead the batch (the GDN speculative kernel reads their gating inputs at
    their own token offsets); the recompute chunk takes the prefill path."""
    from vllm.model_executor.layers.mamba import gdn_linear_attn

    if triton_device == "cpu":
        monkeypatch.setattr(
            gdn_linear_attn, "causal_conv1d_fn", _torch_causal_conv1d_fn
        )
    rig = _Rig(triton_device, 3, monkeypatch)
    rig.layer.chunk_gated_delta_rule = _torch_chunk_gated_delta_rule
    req_ids = ["resumed", "drafted", "nomatch"]
    accepted = {"resumed": 1, "drafted": 2, "nomatch": 3}
    for req, name in enumerate(req_ids):
        rig.prefix(req, offset=accepted[name] - 1)
    # The resumed request's prompt is shorter than what it has computed.
    batch = _Batch(
        [(name, PREFIX, 2 if name == "resumed" else PREFIX) for name in req_ids]
    )
    scheduled = {"resumed": 2, "drafted": 4, "nomatch": 1}
    order, query_lens, counts = _runner_rows(
        batch, scheduled, {"drafted": [11, 12, 13]}
    )
    print("runner order", order, "draft counts", counts)
    rows = [req_ids.index(name) for name in order]
    meta, inputs = rig.run(
        query_lens, [PREFIX] * 3, [accepted[name] for name in order], counts, rows
    )
    print("num_spec_decodes", meta.num_spec_decodes, "num_prefills", meta.num_prefills)
    rig.check(1, rows, query_lens, query_lens, inputs)
