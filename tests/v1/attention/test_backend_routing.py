# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer fallback from a globally chosen attention backend on CUDA.

vllm-project/vllm#41403 Gates 1 and 2: with ``--attention-backend TURBOQUANT``
(or ``TRITON_ATTN`` forced by ``Gemma4Config``) vLLM 0.20.2 raises
``Selected backend ... is not valid for this configuration`` for the first
layer that backend cannot serve. The layer kinds below are those of Gemma 4
(sliding 256 with mm-prefix, full 512 causal once the next patch declares
mm-prefix per layer, TurboQuant or boundary dtype) and Qwen3.5 (full 256,
TurboQuant or boundary dtype). ``CudaPlatform`` runs without a GPU: its
extension modules are stubbed and the device capability is faked.
"""

import sys
import types

import pytest
import torch

pytestmark = pytest.mark.cpu_test

TQ = "turboquant_4bit_nc"
SM90 = (9, 0)
SM120 = (12, 0)

# kind -> (head_size, kv_cache_dtype, use_mm_prefix)
KINDS = {
    "gemma4-sliding": (256, "auto", True),
    "gemma4-full-tq": (512, TQ, False),
    "gemma4-full-boundary": (512, "auto", False),
    "qwen3_5-full-tq": (256, TQ, False),
    "qwen3_5-full-boundary": (256, "auto", False),
}

# (selected, kind) -> (upstream 0.20.2 error reasons, backend patched, by capability)
ROUTED = {
    # Gate 1 (sliding layers with mm-prefix) and Gate 2 (boundary dtype).
    ("TURBOQUANT", "gemma4-sliding"): (
        [
            "kv_cache_dtype not supported",
            "partial multimodal token full attention not supported",
        ],
        {SM90: "TRITON_ATTN", SM120: "TRITON_ATTN"},
    ),
    ("TURBOQUANT", "gemma4-full-boundary"): (
        ["kv_cache_dtype not supported"],
        {SM90: "TRITON_ATTN", SM120: "TRITON_ATTN"},
    ),
    ("TURBOQUANT", "qwen3_5-full-boundary"): (
        ["kv_cache_dtype not supported"],
        {SM90: "FLASH_ATTN", SM120: "FLASH_ATTN"},
    ),
    # Gemma4Config forces TRITON_ATTN for every layer.
    ("TRITON_ATTN", "gemma4-full-tq"): (
        ["kv_cache_dtype not supported"],
        {SM90: "TURBOQUANT", SM120: "TURBOQUANT"},
    ),
    ("TRITON_ATTN", "qwen3_5-full-tq"): (
        ["kv_cache_dtype not supported"],
        {SM90: "TURBOQUANT", SM120: "TURBOQUANT"},
    ),
}

# Combinations the chosen backend serves itself (unchanged by the patch).
KEPT = [
    ("TURBOQUANT", "gemma4-full-tq"),
    ("TURBOQUANT", "qwen3_5-full-tq"),
    ("TRITON_ATTN", "gemma4-sliding"),
    ("TRITON_ATTN", "gemma4-full-boundary"),
]


@pytest.fixture
def cuda(monkeypatch, request):
    """``CudaPlatform`` at a faked capability, with fresh selector caches."""
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    import vllm.platforms
    from vllm.platforms import cuda as cuda_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector

    capability = DeviceCapability(*request.param)
    monkeypatch.setattr(
        cuda_platform.CudaPlatform,
        "get_device_capability",
        classmethod(lambda cls, device_id=0: capability),
    )
    platform = cuda_platform.CudaPlatform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    cuda_platform._get_backend_priorities.cache_clear()
    selector._cached_get_attn_backend.cache_clear()
    yield platform
    cuda_platform._get_backend_priorities.cache_clear()
    selector._cached_get_attn_backend.cache_clear()


def selector_config(kind: str, **overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    head_size, kv_cache_dtype, mm_prefix = KINDS[kind]
    fields = dict(
        head_size=head_size,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mm_prefix=mm_prefix,
    )
    fields.update(overrides)
    return AttentionSelectorConfig(**fields)


def backend(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def select(platform, selected: str | None, kind: str, **overrides) -> str:
    from vllm.v1.attention import selector

    chosen = selector._cached_get_attn_backend(
        backend(selected) if selected else None, selector_config(kind, **overrides)
    )
    return chosen.get_name()


def name_of(path_or_name: str) -> str:
    return {b.get_path(): b.name for b in map(backend, _NAMES)}.get(
        path_or_name, path_or_name
    )


_NAMES = ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT"]


@pytest.mark.parametrize("cuda", [SM90, SM120], indirect=True, ids=["sm90", "sm120"])
@pytest.mark.parametrize(("selected", "kind"), list(ROUTED))
def test_layer_the_chosen_backend_cannot_serve_is_routed(cuda, selected, kind):
    reasons, expected = ROUTED[(selected, kind)]
    # The reasons are the bug report's (0.20.2 raised them as "Reason: [...]").
    invalid = (
        backend(selected)
        .get_class()
        .validate_configuration(
            device_capability=cuda.get_device_capability(),
            **selector_config(kind)._asdict(),
        )
    )
    assert invalid == reasons
    path = cuda.get_attn_backend_cls(backend(selected), selector_config(kind))
    assert name_of(path) == expected[tuple(cuda.get_device_capability())]


@pytest.mark.parametrize("cuda", [SM90, SM120], indirect=True, ids=["sm90", "sm120"])
@pytest.mark.parametrize(("selected", "kind"), KEPT)
def test_layer_the_chosen_backend_serves_keeps_it(cuda, selected, kind):
    path = cuda.get_attn_backend_cls(backend(selected), selector_config(kind))
    assert path == backend(selected).get_path()


@pytest.mark.parametrize("cuda", [SM120], indirect=True, ids=["sm120"])
def test_one_log_line_per_layer_kind(cuda, monkeypatch):
    from vllm.v1.attention import backend_routing

    lines = []

    class _Logger:
        def info_once(self, msg, *args):
            lines.append(msg % args)

    monkeypatch.setattr(backend_routing, "logger", _Logger())
    for _ in range(3):  # several layers of each kind
        for kind in ("gemma4-sliding", "gemma4-full-boundary"):
            cuda.get_attn_backend_cls(backend("TURBOQUANT"), selector_config(kind))
    # info_once deduplicates identical lines: one per (layer kind -> backend).
    distinct = set(lines)
    assert len(distinct) == 2
    sliding = [line for line in distinct if "mm_prefix=True" in line]
    full = [line for line in distinct if "head_size=512" in line]
    assert len(sliding) == len(full) == 1
    assert "use TRITON_ATTN" in sliding[0] and "use TRITON_ATTN" in full[0]


@pytest.mark.parametrize("cuda", [SM90], indirect=True, ids=["sm90"])
def test_no_valid_backend_lists_every_backend(cuda):
    # A full layer that still declares mm-prefix with a TurboQuant dtype:
    # only TurboQuant stores that dtype and it has no mm-prefix support.
    config = selector_config("gemma4-full-tq", use_mm_prefix=True)
    with pytest.raises(ValueError) as error:
        cuda.get_attn_backend_cls(backend("TURBOQUANT"), config)
    message = str(error.value)
    assert "No attention backend can serve layers with head_size=512" in message
    for name in _NAMES:
        assert f"{name}: " in message, name
    assert "partial multimodal token full attention not supported" in message


@pytest.mark.parametrize("cuda", [SM90], indirect=True, ids=["sm90"])
def test_run_wide_reason_is_not_masked(cuda):
    # float32 is the run's dtype, not a layer property: keep upstream's error.
    config = selector_config("qwen3_5-full-boundary", dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"Selected backend .*FLASH_ATTN.*'dtype not supported'"
    ):
        cuda.get_attn_backend_cls(backend("FLASH_ATTN"), config)


@pytest.mark.parametrize("cuda", [SM120], indirect=True, ids=["sm120"])
@pytest.mark.parametrize(
    ("selected", "overrides"),
    [
        # The run's fp8 KV cache, which FA2 cannot store: not a layer property.
        ("FLASH_ATTN", {"kv_cache_dtype": "fp8"}),
        # Per-head quant scales come from the checkpoint's KV scheme.
        ("FLASHINFER", {"kv_cache_dtype": "fp8", "use_per_head_quant_scales": True}),
    ],
    ids=["fp8-fa2", "per-head-scales"],
)
def test_run_wide_kv_choice_is_not_masked(cuda, selected, overrides):
    config = selector_config("qwen3_5-full-boundary", **overrides)
    with pytest.raises(ValueError, match=f"Selected backend .*{selected}"):
        cuda.get_attn_backend_cls(backend(selected), config)


@pytest.mark.parametrize("cuda", [SM120], indirect=True, ids=["sm120"])
def test_cache_does_not_carry_decisions_across_configurations(cuda):
    # Interleave: a TurboQuant layer, a boundary layer, then again, with the
    # flag and without it. Each answer is that configuration's own.
    assert select(cuda, "TURBOQUANT", "qwen3_5-full-tq") == "TURBOQUANT"
    assert select(cuda, "TURBOQUANT", "qwen3_5-full-boundary") == "FLASH_ATTN"
    assert select(cuda, None, "qwen3_5-full-boundary") == "FLASH_ATTN"
    assert select(cuda, None, "qwen3_5-full-tq") == "TURBOQUANT"
    assert select(cuda, "TURBOQUANT", "qwen3_5-full-tq") == "TURBOQUANT"
    assert select(cuda, "TRITON_ATTN", "gemma4-full-boundary") == "TRITON_ATTN"
    assert select(cuda, "TRITON_ATTN", "gemma4-full-tq") == "TURBOQUANT"
    assert select(cuda, "TRITON_ATTN", "gemma4-full-boundary") == "TRITON_ATTN"
