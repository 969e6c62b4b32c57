# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Speculative verify rows as TurboQuant decode rows.

A verify row of a request with ``q`` new tokens (the last accepted token plus
``q - 1`` drafts) is computed as ``q`` decode rows over the compressed cache:
row ``j`` attends to the request's first ``seq_len - q + 1 + j`` tokens. The
store runs before attention, so every row reads its own and earlier drafts'
K/V back quantized, exactly as the same token would be read by a plain decode
step without speculation; this is what keeps greedy outputs with speculation
equal to those without.

The expansion to rows is done by the metadata builder with GPU-only,
static-shape operations into persistent buffers, so a FULL CUDA graph that
captured the decode kernel over those buffers reads, on every replay, the
sequence lengths and block-table rows that the builder wrote for that step.
Host values come only from ``query_start_loc_cpu`` and ``is_prefilling``,
which decide the batch split (also fixed for a captured uniform batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

logger = init_logger(__name__)


class TurboQuantSpecConfigError(ValueError):
    """A speculative configuration the TurboQuant backend cannot serve exactly."""


def check_speculative_config(vllm_config: VllmConfig, layer_names: list[str]) -> None:
    """Refuse, at start-up, speculation whose verify rows are not a causal chain.

    Decode rows model a chain: draft ``j`` sees drafts ``< j``. A token tree
    (EAGLE tree drafts) needs a tree mask, which only TREE_ATTN implements;
    serving it with chain rows would silently change outputs.
    """
    spec = vllm_config.speculative_config
    if spec is None or spec.speculative_token_tree is None:
        return
    import ast

    tree = ast.literal_eval(spec.speculative_token_tree)
    chain = [tuple([0] * (i + 1)) for i in range(len(tree))]
    if [tuple(node) for node in tree] == chain:
        return
    shown = ", ".join(layer_names[:4]) + (" ..." if len(layer_names) > 4 else "")
    raise TurboQuantSpecConfigError(
        "TurboQuant KV cache (backend TURBOQUANT, layers "
        f"{shown}) verifies drafts as a causal chain, but "
        f"speculative_token_tree={spec.speculative_token_tree!r} is a tree: "
        "its verify rows need a tree mask, which only TREE_ATTN provides. "
        "Use a chain (num_speculative_tokens without speculative_token_tree), "
        "or keep these layers at the model dtype with "
        "--kv-cache-dtype-skip-layers, or use --kv-cache-dtype auto."
    )


def decode_row_capacity(vllm_config: VllmConfig) -> int:
    """The most decode rows one step can have: max_num_seqs x (1 + drafts)."""
    rows = vllm_config.scheduler_config.max_num_seqs
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens:
        per_request = 1 + (2 if spec.parallel_drafting else 1) * (
            spec.num_speculative_tokens
        )
        rows *= per_request
    return rows


_SHARED_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def shared_decode_scratch(
    vllm_config: VllmConfig, num_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode scratch (split partials, output, LSE) shared by all layers.

    Layers run one after another and each consumes its decode output before
    the next layer starts, so one set serves them all. Sized for every decode
    row of a speculative step; per-layer copies at that size would cost
    (1 + k) times what 0.20.2 already spends per layer. Allocated where the
    model is built (on the GPU under the loader's device context), so it is
    in place before the memory profiler runs and ``model.to()`` keeps it.
    """
    rows = decode_row_capacity(vllm_config)
    splits = vllm_config.attention_config.tq_max_kv_splits_for_cuda_graph
    device = torch.empty(0).device
    key = (rows, num_heads, splits, head_size, str(device))
    if key not in _SHARED_SCRATCH:
        _SHARED_SCRATCH[key] = (
            torch.empty(rows, num_heads, splits, head_size + 1, dtype=torch.float32),
            torch.empty(rows, num_heads, head_size, dtype=torch.float32),
            torch.empty(rows, num_heads, dtype=torch.float32),
        )
    return _SHARED_SCRATCH[key]


def split_verify_batch(
    cam: CommonAttentionMetadata, threshold: int
) -> tuple[int, int, int]:
    """(num_decodes, num_decode_tokens, num_prefills) of a reordered batch.

    Rows of at most ``threshold`` tokens that are done prefilling are decode
    rows. A short first chunk or chunked-prefill tail stays a prefill row: the
    prefill path attends to its raw K/V, and a run without speculation (where
    the threshold is 1) computes it that way too. Zero-length rows are
    CUDA-graph padding and count as decode rows, whatever stale
    ``is_prefilling`` value their slot holds.
    """
    qsl = cam.query_start_loc_cpu[: cam.num_reqs + 1]
    q_lens = qsl[1:] - qsl[:-1]
    is_prefill = q_lens > threshold
    if cam.is_prefilling is not None:
        is_prefill |= cam.is_prefilling[: cam.num_reqs].to(torch.bool) & (q_lens > 0)
    if not bool(is_prefill.any()):
        return cam.num_reqs, cam.num_actual_tokens, 0
    num_decodes = int(is_prefill.int().argmax())
    return num_decodes, int(qsl[num_decodes]), cam.num_reqs - num_decodes


class VerifyRowBuffers:
    """Persistent per-row sequence lengths and block-table rows of a builder."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.capacity = max(
            decode_row_capacity(vllm_config),
            vllm_config.scheduler_config.max_num_batched_tokens,
        )
        self.device = device
        self.seq_lens = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self.rows = torch.arange(self.capacity, dtype=torch.int32, device=device)
        self.requests = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self.block_table: torch.Tensor | None = None

    def _block_table_buffer(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        bt = self.block_table
        if bt is None or bt.shape[1] != width or bt.dtype != dtype:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "TurboQuant verify rows: the block table changed width "
                    f"({None if bt is None else bt.shape[1]} -> {width}) during "
                    "CUDA graph capture; a buffer allocated now would not be "
                    "the one later replays read."
                )
            bt = torch.zeros(self.capacity, width, dtype=dtype, device=self.device)
            self.block_table = bt
        return bt

    def expand(
        self, cam: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write one row per decode token; return (seq_lens, block_table,
        requests) views.

        Token ``t`` of request ``r`` (query ``[s, e)``) gets sequence length
        ``seq_lens[r] - (e - s) + 1 + (t - s)``, block-table row ``r`` and
        request ``r`` (for another group's block table, e.g. a raw window's).
        Tokens past the last request's query (graph padding) get length 0.
        """
        n = num_decode_tokens
        if n > self.capacity:
            raise RuntimeError(
                f"TurboQuant verify rows: {n} decode tokens exceed the "
                f"{self.capacity} rows sized from max_num_seqs x (1 + "
                "num_speculative_tokens) and max_num_batched_tokens."
            )
        src_bt = cam.block_table_tensor
        bt = self._block_table_buffer(src_bt.shape[1], src_bt.dtype)
        if n == 0 or num_decodes == 0:
            return self.seq_lens[:0], bt[:0], self.requests[:0]
        qsl = cam.query_start_loc[: num_decodes + 1]
        tokens = self.rows[:n]
        req = torch.searchsorted(qsl[1:], tokens, right=True, out_int32=True)
        req.clamp_(max=num_decodes - 1)
        start = qsl[req]
        q_len = qsl[req + 1] - start
        lens = cam.seq_lens[req] - q_len + 1 + (tokens - start)
        lens = torch.where(tokens < qsl[num_decodes], lens, 0)
        self.seq_lens[:n].copy_(lens)
        torch.index_select(src_bt, 0, req, out=bt[:n])
        self.requests[:n].copy_(req)
        return self.seq_lens[:n], bt[:n], self.requests[:n]
