# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer fallback when a globally chosen attention backend cannot serve a layer.

A backend chosen for the whole model (``--attention-backend``, or a model
config such as ``Gemma4Config`` forcing ``TRITON_ATTN``) is checked against
every layer's own configuration. Layers differ: TurboQuant's boundary layers
keep the model dtype, Gemma 4's full layers have head_dim 512 and only its
sliding layers attend bidirectionally over image tokens. Upstream 0.20.2 raises
for the first layer the chosen backend cannot serve, so no single choice works
for such models (vllm-project/vllm#41403, Gates 1 and 2).

Here a layer whose *own* properties rule the chosen backend out gets the best
valid backend by the platform's normal priority instead; a reason that holds
for the run (missing kernels, compute capability, model dtype, user block
size, batch invariance, per-head quant scales, a KV dtype such as fp8 that the
chosen backend cannot store) still raises, so an unusable choice is not masked.

The decision depends only on the arguments of
``selector._cached_get_attn_backend`` (chosen backend, selector config,
``num_heads``) and on the device, so its ``@cache`` cannot carry a decision
from one layer configuration into another.
"""

from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

# ``AttentionBackend.validate_configuration`` reasons that come from a layer's
# own configuration (head size, mm-prefix, sinks, attention type) rather than
# from the run. The KV dtype is handled in ``_is_layer_reason``.
LAYER_REASONS = frozenset(
    {
        "head_size not supported",
        "partial multimodal token full attention not supported",
        "attention sinks not supported",
    }
)
KV_DTYPE_REASON = "kv_cache_dtype not supported"


def _is_turboquant(kv_cache_dtype) -> bool:
    return str(kv_cache_dtype or "").startswith("turboquant_")


def _is_layer_reason(
    reason: str, selected: "AttentionBackendEnum", config: "AttentionSelectorConfig"
) -> bool:
    if reason in LAYER_REASONS:
        return True
    if reason.startswith("attention type ") and reason.endswith(" not supported"):
        return True
    if reason == KV_DTYPE_REASON:
        # A KV dtype is a layer's own when TurboQuant and the chosen backend
        # disagree about it: TurboQuant's skip rules keep some layers at the
        # model dtype, and only TurboQuant stores its dtypes. Any other dtype
        # mismatch (fp8 with a backend without fp8) is the run's: it still raises.
        return _is_turboquant(config.kv_cache_dtype) != (selected.name == "TURBOQUANT")
    return False


def describe_layer(config: "AttentionSelectorConfig") -> str:
    """The layer kind, as the properties that decide its backend."""
    return (
        f"head_size={config.head_size}, kv_cache_dtype={config.kv_cache_dtype}, "
        f"mm_prefix={config.use_mm_prefix}, sinks={config.has_sink}, "
        f"attn_type={config.attn_type}"
    )


def _format_reasons(reasons: dict) -> str:
    return "; ".join(
        f"{backend.name}: {', '.join(why)}" for backend, (_, why) in reasons.items()
    )


def _runtime_reason(backend, config, reasons: dict, priority: int) -> bool:
    """Record why ``backend`` would fail at run time although it validated.

    ``FlashAttentionBackend.supports_head_size`` accepts head sizes up to 512
    whenever FlashAttention 4 can be imported, but the version that runs is
    chosen separately (FA3 on Hopper, FA2 for TurboQuant runs), and only FA4
    has kernels above 256. Gemma 4's full layers (512) must not be routed there.
    """
    if backend.name != "FLASH_ATTN" or config.head_size <= 256:
        return False
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    version = get_flash_attn_version(head_size=config.head_size)
    if version == 4:
        return False
    why = f"head_size {config.head_size} needs FlashAttention 4, not {version}"
    reasons[backend] = (priority, [why])
    return True


def route_selected_backend(
    platform,
    selected: "AttentionBackendEnum",
    invalid_reasons: list[str],
    device_capability: "DeviceCapability",
    attn_selector_config: "AttentionSelectorConfig",
    num_heads: int | None = None,
) -> str:
    """Backend path for a layer the chosen backend ``selected`` cannot serve.

    Raises the upstream error when a reason is not a layer property, and a
    ``ValueError`` naming every backend's reasons when none is valid.
    """
    upstream_error = ValueError(
        f"Selected backend {selected} is not valid for this configuration. "
        f"Reason: {invalid_reasons}"
    )
    if not all(
        _is_layer_reason(r, selected, attn_selector_config) for r in invalid_reasons
    ):
        raise upstream_error

    valid, reasons = platform.get_valid_backends(
        device_capability=device_capability,
        attn_selector_config=attn_selector_config,
        num_heads=num_heads,
    )
    valid = [
        (backend, priority)
        for backend, priority in valid
        if not _runtime_reason(backend, attn_selector_config, reasons, priority)
    ]
    layer = describe_layer(attn_selector_config)
    if not valid:
        raise ValueError(
            f"No attention backend can serve layers with {layer}: the selected "
            f"{selected.name} is not valid ({', '.join(invalid_reasons)}), and "
            f"neither is any other backend on {platform.device_name} "
            f"(capability {device_capability.as_version_str()}): "
            f"{_format_reasons(reasons)}. Change the layers' configuration "
            "(e.g. --kv-cache-dtype, --kv-cache-dtype-skip-layers) or install "
            "a backend that supports it."
        ) from upstream_error

    backend = min(valid, key=lambda item: item[1])[0]
    logger.info_once(
        "Attention backend %s cannot serve layers with %s (%s); those layers "
        "use %s, the best valid backend for them.",
        selected.name,
        layer,
        ", ".join(invalid_reasons),
        backend.name,
    )
    return backend.get_path()
