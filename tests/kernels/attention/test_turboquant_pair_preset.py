# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``turboquant_3bit_pair_nc`` through the backend: a layer whose codebook is
the pair code's stores each pair of rotated key coordinates as one of 64
points (the bytes ``turboquant_store`` writes with that codebook) and reads
them back as such in the decode rows, first chunks and continuation of one
mixed step. Runs under the Triton CPU interpreter
(``HYBRIDKV_TRITON_INTERPRET=1``) and natively on a GPU."""

import torch

from tests.kernels.attention.test_turboquant_prefill_batch import (
    D,
    _error,
    _run,
    _slots,
    flash,  # noqa: F401 (fixture)
)
from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.model_executor.layers.quantization.turboquant.key_codebook import (
    key_codebook,
)
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store

PRESET = "turboquant_3bit_pair_nc"


def _kv(n, device):
    """Gaussian keys; values whose rotation (the layer stores values rotated)
    lies on a 3-bit grid with both ends present, so only the keys lose."""
    g = torch.Generator().manual_seed(n)
    k = torch.randn(n, 2, D, generator=g)
    grid = torch.randint(0, 8, (n, 2, D), generator=g).float() / 4 - 1
    grid[..., 0], grid[..., 1] = -1.0, 0.75
    v = grid @ _build_hadamard(D, "cpu")
    return k.to(device), v.to(device)


def test_a_mixed_step_reads_the_pairs_it_stored(
    triton_device,
    flash,  # noqa: F811 (the fixture imported above)
    monkeypatch,
):
    cfg = TurboQuantConfig.from_cache_dtype(PRESET, D)
    points = key_codebook(cfg, D).to(triton_device)
    run = _run(PRESET, triton_device, monkeypatch, make_kv=_kv, codebook=points)

    # The store the backend ran is the pair code's.
    cache = torch.zeros_like(run.cache)
    lens = [len(k) for k, _ in run.seqs]
    turboquant_store(
        torch.cat([k for k, _ in run.seqs]), torch.cat([v for _, v in run.seqs]),
        cache, _slots(run.table, [0] * len(lens), lens),
        _build_hadamard(D, str(triton_device)), points, **store_kwargs(cfg),
        value_rotation=True,
    )  # fmt: skip
    assert torch.equal(cache, run.cache)

    # Read as pairs, the step is within the code's error of the model's
    # attention; read as levels (the same bytes), it is not: 0.068 against
    # 0.37 under the Triton interpreter, 0.30 on an H200.
    misread = _run(
        PRESET, triton_device, monkeypatch, make_kv=_kv,
        codebook=points[:8, 0].sort().values,
    )  # fmt: skip
    assert _error(run) < 0.1 and _error(misread) > 2.5 * _error(run)
