# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache capacity planner: what the engine would plan, without a GPU.

``plan_capacity(CapacityRequest(...))`` returns a :class:`CapacityReport`;
``vllm kv-capacity`` (vllm/entrypoints/cli/kv_capacity.py) is its command line.

The config goes through ``EngineArgs.create_engine_config`` (the same checks,
skip lists and cache settings as ``vllm serve``); each layer's KV-cache spec is
built by ``Attention.get_kv_cache_spec`` / ``MambaSpec`` from the layer
geometry in the HF config; block sizes come from the hybrid page planner and
the groups, page sizes and block counts from ``get_kv_cache_configs``. Given
the same KV-cache memory (``kv_cache_memory_bytes``), the token count equals
the engine's "GPU KV cache size" line. The attention backend of each layer
kind is what CUDA's own selection answers for the requested compute
capability.

Inputs the engine would refuse later (at model load, or never: a value that
describes no GPU) raise :class:`CapacityInputError` naming the value, the rule
and the fix. A configuration the engine refuses during planning is a report
with ``error`` set; any other exception is a bug of the planner and propagates.

This module only uses APIs that upstream vLLM 0.20.2 also has, plus the
hybridkv planner when present, so it can also be run against an unpatched
install (``pristine=True``) to show what 0.20.2 would do.
"""

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# CUDA's default: FlashAttention / Triton / TurboQuant accept multiples of 16.
CUDA_BLOCK_ALIGNMENT = 16
GIB = 2**30
DEFAULT_DEVICE_CAPABILITY = "9.0"

# Exceptions the engine raises when it refuses a configuration while planning
# (config validation, skip-list rules, page unification, 0.20.2's bare asserts).
ENGINE_REFUSALS = (ValueError, AssertionError, NotImplementedError)


class CapacityInputError(ValueError):
    """A planner input that the engine would refuse, or that describes no GPU."""


@dataclass(frozen=True)
class CapacityRequest:
    model: str
    """Local directory holding the model's config.json."""
    max_model_len: int
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: tuple[str, ...] = ()
    tensor_parallel_size: int = 1
    num_speculative_tokens: int = 0
    draft: str | None = None
    """Draft model directory (method draft_model); without it, MTP."""
    block_size: int | None = None
    language_model_only: bool = False
    attention_backend: str | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    weights_gib: float | None = None
    overhead_gib: float = 1.0
    device_capability: str = DEFAULT_DEVICE_CAPABILITY
    """CUDA compute capability the backends are chosen for, e.g. 9.0 or 12.0."""
    pristine: bool = False


@dataclass
class LayerGeometry:
    name: str
    kind: str  # "full", "sliding" or "mamba"
    num_kv_heads: int = 0
    head_size: int = 0
    sliding_window: int | None = None


@dataclass
class CapacityReport:
    model: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    max_model_len: int
    kv_cache_memory_bytes: int
    vllm: str
    device_capability: str = DEFAULT_DEVICE_CAPABILITY
    error: str | None = None
    """Why the engine would refuse this configuration while planning."""
    block_size: int | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    page_size_bytes: int | None = None
    padding_bytes_per_page_set: int = 0
    padding_fraction: float = 0.0
    num_blocks: int | None = None
    kv_tokens: int | None = None
    max_concurrency: float | None = None
    layer_dtypes: dict[str, int] = field(default_factory=dict)
    attention_backends: dict[str, str] = field(default_factory=dict)
    """Layer kind -> the backend CUDA's selection picks for it."""
    backend_errors: dict[str, str] = field(default_factory=dict)
    """Layer kind -> why no backend would serve it (the engine fails to start)."""
    pad_to_max_fraction: float | None = None
    """Padding if every page were padded to the largest, unscaled (upstream
    0.33's unification), for comparison."""

    @property
    def fails(self) -> bool:
        return self.error is not None or bool(self.backend_errors)


class EngineRefusal(Exception):
    def __init__(self, step: str, cause: BaseException):
        super().__init__(f"{step}: {type(cause).__name__}: {cause}")


@contextlib.contextmanager
def _engine_step(step: str) -> Iterator[None]:
    """Turn a refusal raised by engine code into a report; let bugs propagate."""
    try:
        yield
    except ENGINE_REFUSALS as e:
        raise EngineRefusal(step, e) from e


# --- inputs -----------------------------------------------------------------


def _model_dir(flag: str, value: str) -> None:
    path = Path(value)
    if not path.is_dir():
        raise CapacityInputError(
            f"{flag} {value}: no such directory. kv-capacity reads the model's "
            "config.json from a local directory (no download); fetch it with "
            f"`hf download <repo id> config.json --local-dir {value}`."
        )
    config = path / "config.json"
    if not config.is_file():
        raise CapacityInputError(
            f"{flag} {value}: the directory has no config.json. Point it at the "
            "model directory (the one holding config.json)."
        )
    # transformers' own error for it is a traceback, raised inside the planner.
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CapacityInputError(
            f"{flag} {value}: its config.json is not valid JSON ({e}). Fetch the "
            "model's config.json again."
        ) from e
    if not isinstance(parsed, dict):
        raise CapacityInputError(
            f"{flag} {value}: its config.json holds a JSON {type(parsed).__name__}, "
            "expected an object of the model's settings. Fetch the model's "
            "config.json again."
        )


def _positive(flag: str, value: float | None, fix: str) -> None:
    if value is not None and not value > 0:
        raise CapacityInputError(f"{flag} {value}: must be greater than 0. {fix}")


def parse_device_capability(value: str) -> tuple[int, int]:
    text = value.strip().lower().removeprefix("sm_").removeprefix("sm")
    major, dot, minor = text.partition(".")
    if not dot and text.isdigit() and len(text) >= 2:
        major, minor = text[:-1], text[-1]
    if not (major.isdigit() and minor.isdigit()):
        raise CapacityInputError(
            f"--device-capability {value}: expected a CUDA compute capability "
            "MAJOR.MINOR, e.g. 8.9 (L4/RTX 40), 9.0 (H100) or 12.0 (RTX 50)."
        )
    return int(major), int(minor)


def check_request(req: CapacityRequest) -> None:
    """Refuse, by name, inputs that cannot describe a run of the engine."""
    _model_dir("MODEL_DIR", req.model)
    if req.draft is not None:
        _model_dir("--draft", req.draft)
    _positive("--max-model-len", req.max_model_len, "Give the context length to plan.")
    _positive(
        "--tensor-parallel-size",
        req.tensor_parallel_size,
        "It is the number of GPUs the model is sharded over (1 for one GPU).",
    )
    if req.num_speculative_tokens < 0:
        raise CapacityInputError(
            f"--num-speculative-tokens {req.num_speculative_tokens}: must be 0 "
            "(no speculative decoding) or more."
        )
    if req.draft is not None and req.num_speculative_tokens == 0:
        raise CapacityInputError(
            f"--draft {req.draft}: needs --num-speculative-tokens N (N >= 1), the "
            "tokens the draft model proposes per step."
        )
    _positive("--block-size", req.block_size, "Leave it out to plan the default.")
    parse_device_capability(req.device_capability)
    if req.kv_cache_memory_bytes is not None:
        _positive(
            "--kv-cache-memory-bytes",
            req.kv_cache_memory_bytes,
            "It is the KV-cache memory per GPU, as the engine's kv_cache_memory_bytes.",
        )
        return
    if req.gpu_memory_gib is None or req.weights_gib is None:
        raise CapacityInputError(
            "no memory to plan with: give --kv-cache-memory-bytes (the KV-cache "
            "memory per GPU), or --gpu-memory-gib (one GPU's memory) and "
            "--weights-gib (the whole model's weights; divided by the "
            "tensor-parallel size)."
        )
    _positive("--gpu-memory-gib", req.gpu_memory_gib, "It is one GPU's memory in GiB.")
    _positive(
        "--weights-gib", req.weights_gib, "It is the whole model's weights in GiB."
    )
    if not 0 < req.gpu_memory_utilization <= 1:
        raise CapacityInputError(
            f"--gpu-memory-utilization {req.gpu_memory_utilization}: must be in "
            "(0, 1], the share of each GPU's memory vLLM may use (e.g. 0.9)."
        )
    if req.overhead_gib < 0:
        raise CapacityInputError(
            f"--overhead-gib {req.overhead_gib}: must be 0 or more (activations, "
            "CUDA graphs and NCCL buffers per GPU)."
        )


def available_kv_memory(req: CapacityRequest) -> int:
    if req.kv_cache_memory_bytes is not None:
        return req.kv_cache_memory_bytes
    assert req.gpu_memory_gib is not None and req.weights_gib is not None
    usable = req.gpu_memory_gib * req.gpu_memory_utilization
    weights = req.weights_gib / req.tensor_parallel_size
    per_gpu = usable - weights - req.overhead_gib
    if per_gpu <= 0:
        raise CapacityInputError(
            f"nothing left for the KV cache: {req.gpu_memory_gib} GiB x "
            f"{req.gpu_memory_utilization} = {usable:.2f} GiB per GPU, minus weights "
            f"{weights:.2f} GiB (--weights-gib / --tensor-parallel-size) and "
            f"--overhead-gib {req.overhead_gib} leaves {per_gpu:.2f} GiB. Use more "
            "or larger GPUs, a higher --gpu-memory-utilization, or smaller weights."
        )
    return int(per_gpu * GIB)


# Dimensions each tensor-parallel rank takes an equal share of, as vLLM's
# linear layers shard them (anything else fails an assert at model load).
_SHARDED = (
    ("num_attention_heads", "query heads"),
    ("intermediate_size", "MLP intermediate size"),
    ("moe_intermediate_size", "MoE expert intermediate size"),
    ("shared_expert_intermediate_size", "shared-expert intermediate size"),
    ("linear_num_key_heads", "linear-attention (GDN) key heads"),
    ("linear_num_value_heads", "linear-attention (GDN) value heads"),
    ("mamba_n_heads", "Mamba heads"),
)
# KV heads shard when there are at least as many as ranks, else replicate,
# which needs the rank count to be a multiple (QKVParallelLinear).
_KV_HEADS = (
    ("num_key_value_heads", "KV heads"),
    ("num_global_key_value_heads", "full-attention KV heads"),
)


def _layer_config(text_config: Any, i: int) -> Any:
    # transformers >= 5.15 keeps attention shapes that differ per layer (Gemma
    # 4's head_dim / KV heads) in per_layer_config; reading the global
    # attribute then raises AmbiguousGlobalPerLayerAttributeError.
    if getattr(text_config, "is_heterogeneous", False):
        return text_config.per_layer_config[i]
    return text_config


def _values(text_config: Any, attr: str) -> list[Any]:
    """``attr`` of ``text_config``: every layer's value where it is per-layer."""
    if attr in (getattr(text_config, "per_layer_attributes", None) or ()):
        layers = text_config.per_layer_config
        return sorted({getattr(layer, attr) for layer in layers}, reverse=True)
    return [getattr(text_config, attr, None)]


def tensor_parallel_problems(text_config: Any, tp: int) -> list[str]:
    problems = []
    for attr, what in _SHARDED:
        for value in _values(text_config, attr):
            if isinstance(value, int) and value > 0 and value % tp:
                problems.append(f"{attr}={value} ({what}) is not a multiple of {tp}")
    for attr, what in _KV_HEADS:
        for value in _values(text_config, attr):
            if not (isinstance(value, int) and value > 0):
                continue
            if (value >= tp and value % tp) or (value < tp and tp % value):
                problems.append(
                    f"{attr}={value} ({what}) can be neither split evenly over {tp} "
                    f"ranks nor replicated ({tp} is not a multiple of {value})"
                )
    return problems


def check_tensor_parallel(text_config: Any, tp: int, flag: str) -> None:
    problems = tensor_parallel_problems(text_config, tp)
    if problems:
        fits = [n for n in range(1, 65) if not tensor_parallel_problems(text_config, n)]
        raise CapacityInputError(
            f"{flag} {tp}: the model cannot be sharded over {tp} GPUs: "
            + "; ".join(problems)
            + ". The engine would stop at model load. Sizes that shard evenly: "
            + ", ".join(str(n) for n in fits[:8])
            + "."
        )


def check_skip_layers(req: CapacityRequest, num_layers: int) -> None:
    for entry in req.kv_cache_dtype_skip_layers:
        if entry.isdigit() and int(entry) >= num_layers:
            raise CapacityInputError(
                f"--kv-cache-dtype-skip-layers {entry}: the model has {num_layers} "
                f"layers (indices 0-{num_layers - 1}), so this entry would skip "
                "nothing. Give an index in range, 'boundary:N', 'draft' or "
                "'sliding_window'."
            )


# --- platform -----------------------------------------------------------------


def _planning_platform_cls() -> type:
    from vllm.platforms.cpu import CpuPlatform

    class CudaTargetPlanningPlatform(CpuPlatform):
        """Builds configs for a CUDA run on a host without a GPU: the CPU
        backend's own rules (block size 128, no quantized KV cache) are not
        the target's, so its config check is left out."""

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            return None

    return CudaTargetPlanningPlatform


def use_planning_platform() -> None:
    """Plan for CUDA on a host that has no GPU, before vLLM picks a platform.

    A plain install on such a host resolves no platform at all ("Failed to
    infer device type"); call this before ``vllm.config`` is imported.
    """
    import vllm.platforms as platforms

    if platforms._current_platform is not None:
        return
    qualname = platforms.resolve_current_platform_cls_qualname()
    if not qualname.endswith(".CudaPlatform"):
        platforms._current_platform = _planning_platform_cls()()


@contextlib.contextmanager
def _cuda_target_config_check() -> Iterator[None]:
    # A CPU platform resolved before the planner ran (vLLM's CPU build, or a
    # test run) must not apply CPU rules to a config planned for CUDA: leave
    # its config check out for this call only.
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "check_and_update_config" in vars(
        current_platform
    ):
        yield
        return
    current_platform.check_and_update_config = lambda vllm_config: None
    try:
        yield
    finally:
        del current_platform.check_and_update_config


def _cuda_platform_cls(capability: tuple[int, int]) -> type:
    """vLLM's CUDA platform, answering for ``capability`` instead of a device."""
    stubs = []
    # vllm.platforms.cuda loads the CUDA extensions, which need libcuda; the
    # backend selection itself does not.
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:
                sys.modules[name] = types.ModuleType(name)
                stubs.append(name)
    try:
        from vllm.platforms.cuda import CudaPlatform
        from vllm.platforms.interface import DeviceCapability
    finally:
        for name in stubs:
            del sys.modules[name]

    class CudaTarget(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

    return CudaTarget


# --- layers and specs ---------------------------------------------------------


def layer_geometry(
    model_config: Any, tp: int, prefix: str = "model.layers"
) -> list[LayerGeometry]:
    """Attention and Mamba layers of a decoder, from its HF config."""
    text = model_config.hf_text_config
    n = text.num_hidden_layers
    types_ = getattr(text, "layer_types", None) or getattr(
        text, "layers_block_type", None
    )
    types_ = list(types_ or ["full_attention"] * n)[:n]

    def per_rank(heads: int) -> int:
        return max(1, heads // tp)

    layers = []
    for i, kind in enumerate(types_):
        attn = f"{prefix}.{i}.self_attn.attn"
        layer = _layer_config(text, i)
        if kind in ("linear_attention", "mamba"):
            layers.append(LayerGeometry(f"{prefix}.{i}.linear_attn", "mamba"))
        elif kind == "sliding_attention":
            heads = per_rank(layer.num_key_value_heads)
            layers.append(
                LayerGeometry(
                    attn, "sliding", heads, layer.head_dim, text.sliding_window
                )
            )
        elif layer is not text:
            # Per-layer config: the full layer's own heads and head_dim.
            heads = per_rank(layer.num_key_value_heads)
            layers.append(LayerGeometry(attn, "full", heads, layer.head_dim))
        elif getattr(text, "global_head_dim", None):
            # Gemma 4: full-attention layers have their own heads and head_dim.
            heads = (
                getattr(text, "num_global_key_value_heads", None)
                or text.num_key_value_heads
            )
            layers.append(
                LayerGeometry(attn, "full", per_rank(heads), text.global_head_dim)
            )
        else:
            heads = per_rank(model_config.get_total_num_kv_heads())
            layers.append(
                LayerGeometry(attn, "full", heads, model_config.get_head_size())
            )
    return layers


def mtp_layer_count(text: Any) -> int:
    return int(
        getattr(text, "mtp_num_hidden_layers", 0)
        or getattr(text, "num_nextn_predict_layers", 0)
        or 0
    )


def all_layers(vllm_config: Any) -> list[LayerGeometry]:
    """Main model, MTP head and draft model layers, named as the engine names them."""
    model_config = vllm_config.model_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    layers = layer_geometry(model_config, tp)
    spec_config = vllm_config.speculative_config
    if spec_config is None:
        return layers
    full = next((g for g in layers if g.kind == "full"), None)
    if spec_config.method == "mtp" and full is not None:
        for i in range(mtp_layer_count(model_config.hf_text_config)):
            layers.append(replace(full, name=f"mtp.layers.{i}.self_attn.attn"))
    elif spec_config.method == "draft_model":
        draft = spec_config.draft_model_config
        draft_tp = spec_config.draft_tensor_parallel_size or tp
        layers += layer_geometry(draft, draft_tp, prefix="draft_model.model.layers")
    return layers


def _pristine_layer_dtype(
    name: str, window: int | None, dtype: str, skip: list[str]
) -> str:
    """vLLM 0.20.2's per-layer rule (model_executor/layers/attention/attention.py)."""
    from vllm.model_executor.models.utils import extract_layer_index

    if not skip:
        return dtype
    if window is not None and "sliding_window" in skip:
        return "auto"
    if str(extract_layer_index(name)) in skip:
        return "auto"
    return dtype


def layer_kv_dtype(vllm_config: Any, layer: LayerGeometry, pristine: bool) -> str:
    cache_config = vllm_config.cache_config
    dtype = cache_config.cache_dtype
    if pristine:
        skip = list(cache_config.kv_cache_dtype_skip_layers or [])
        return _pristine_layer_dtype(layer.name, layer.sliding_window, dtype, skip)
    from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
        layer_kv_cache_dtype,
    )

    dtype, _ = layer_kv_cache_dtype(
        layer.name, layer.sliding_window, dtype, cache_config, vllm_config.model_config
    )
    return dtype


def attention_spec(
    vllm_config: Any, layer: LayerGeometry, pristine: bool
) -> tuple[Any, str]:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType

    dtype = layer_kv_dtype(vllm_config, layer, pristine)
    stand_in = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=dtype,
        kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(
            dtype, vllm_config.model_config
        ),
        sliding_window=layer.sliding_window,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        head_size_v=layer.head_size,
    )
    return Attention.get_kv_cache_spec(stand_in, vllm_config), dtype


def mamba_spec(vllm_config: Any) -> Any:
    """What ``MambaBase.get_kv_cache_spec`` builds for each GDN/Mamba layer."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    spec_config = vllm_config.speculative_config
    # mamba_type only labels the group here (the page size comes from shapes
    # and dtypes); the Qwen3.5/3.6/Next layers are Gated DeltaNet.
    qwen3 = "qwen3" in model_config.hf_text_config.model_type
    return MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
        mamba_type="gdn_attention" if qwen3 else "mamba2",
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_speculative_blocks=spec_config.num_speculative_tokens if spec_config else 0,
    )


class _CudaKernelBlocks:
    """Stands in for the CUDA attention backend when planning on a CPU."""

    @staticmethod
    def get_supported_kernel_block_sizes():
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(CUDA_BLOCK_ALIGNMENT)]


def unpadded_page_size_bytes(spec: Any) -> int:
    """The bytes a page of ``spec`` really stores (padding excluded): the page
    model of ``kv_cache_page_unify``, which an unpatched vLLM lacks."""
    try:
        from vllm.v1.core.kv_cache_page_unify import unpadded_page_size_bytes
    except ImportError:
        if getattr(spec, "page_size_padded", None) is None:
            return spec.page_size_bytes
        return replace(spec, page_size_padded=None).page_size_bytes
    return unpadded_page_size_bytes(spec)


def plan_block_size(
    vllm_config: Any, layers: list[LayerGeometry], pristine: bool
) -> None:
    """``Platform.update_block_size_for_backend`` for a CUDA run."""
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform

    cache_config = vllm_config.cache_config
    if not cache_config.user_specified_block_size:
        cache_config.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
    if not vllm_config.model_config.is_hybrid:
        return
    if pristine:
        Platform._align_hybrid_block_size(vllm_config, _CudaKernelBlocks)  # type: ignore[arg-type]
        return
    from vllm.v1.core.kv_cache_page_planner import apply_hybrid_page_plan
    from vllm.v1.core.kv_cache_page_unify import bytes_per_token

    per_token: dict[int, int] = {}
    for layer in layers:
        if layer.kind != "mamba":
            spec, _ = attention_spec(vllm_config, layer, pristine)
            one = bytes_per_token(spec)
            per_token[one] = per_token.get(one, 0) + 1
    mamba = unpadded_page_size_bytes(mamba_spec(vllm_config))
    apply_hybrid_page_plan(
        vllm_config,
        mamba,
        max(per_token),
        max(CUDA_BLOCK_ALIGNMENT, cache_config.block_size),
        cache_config.mamba_block_size
        if cache_config.user_specified_mamba_block_size
        else None,
        per_token=per_token,
        num_mamba_layers=sum(1 for g in layers if g.kind == "mamba"),
    )


def kv_cache_specs(
    vllm_config: Any, layers: list[LayerGeometry], pristine: bool
) -> tuple[dict, dict]:
    specs: dict[str, Any] = {}
    dtypes: dict[str, int] = {}
    has_mamba = any(g.kind == "mamba" for g in layers)
    mamba = mamba_spec(vllm_config) if has_mamba else None
    for layer in layers:
        if layer.kind == "mamba":
            specs[layer.name] = mamba
            continue
        spec, dtype = attention_spec(vllm_config, layer, pristine)
        specs[layer.name] = spec
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
    return specs, dtypes


def mm_prefix_layer_kinds(model_config: Any) -> frozenset[str] | None:
    """The layer kinds ("full", "sliding") of an mm-prefix model that attend
    bidirectionally over image tokens, where its model class declares them
    (``mm_prefix_layer_kinds``); None: every layer, which is what ``Attention``
    assumes for a model that declares nothing."""
    if not model_config.is_mm_prefix_lm:
        return None
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architectures, model_config
    )
    return getattr(model_cls, "mm_prefix_layer_kinds", None)


def attention_backends(
    vllm_config: Any,
    layers: list[LayerGeometry],
    capability: tuple[int, int],
    pristine: bool,
) -> tuple[dict[str, str], dict[str, str]]:
    """The backend CUDA's selection (``get_attn_backend_cls``) picks for each
    kind of attention layer, with the selector config ``Attention`` builds."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cuda = _cuda_platform_cls(capability)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    block_size = (
        cache_config.block_size if cache_config.user_specified_block_size else None
    )
    chosen: dict[str, str] = {}
    failed: dict[str, str] = {}
    mm_prefix_kinds = mm_prefix_layer_kinds(model_config)
    for layer in layers:
        if layer.kind == "mamba":
            continue
        dtype = layer_kv_dtype(vllm_config, layer, pristine)
        kind = f"{layer.kind} attention, head_size {layer.head_size}, KV {dtype}"
        if kind in chosen or kind in failed:
            continue
        selector = AttentionSelectorConfig(
            head_size=layer.head_size,
            dtype=model_config.dtype,
            kv_cache_dtype=dtype,
            block_size=block_size,
            use_mm_prefix=model_config.is_mm_prefix_lm
            and (mm_prefix_kinds is None or layer.kind in mm_prefix_kinds),
            attn_type=AttentionType.DECODER,
        )
        try:
            path = cuda.get_attn_backend_cls(
                vllm_config.attention_config.backend, selector
            )
        except ValueError as e:
            failed[kind] = str(e)
            continue
        backend = importlib.import_module(path.rpartition(".")[0])
        chosen[kind] = getattr(backend, path.rpartition(".")[2]).get_name()
    return chosen, failed


# --- plan ---------------------------------------------------------------------


def has_layer_policy() -> bool:
    return (
        importlib.util.find_spec(
            "vllm.model_executor.layers.quantization.turboquant.layer_policy"
        )
        is not None
    )


def engine_config(req: CapacityRequest) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    speculative = None
    if req.draft:
        speculative = {
            "method": "draft_model",
            "model": req.draft,
            "num_speculative_tokens": req.num_speculative_tokens,
        }
    elif req.num_speculative_tokens:
        speculative = {
            "method": "mtp",
            "num_speculative_tokens": req.num_speculative_tokens,
        }
    engine_args = EngineArgs(
        model=req.model,
        kv_cache_dtype=req.kv_cache_dtype,
        tensor_parallel_size=req.tensor_parallel_size,
        max_model_len=req.max_model_len,
        skip_tokenizer_init=True,
        load_format="dummy",
        speculative_config=speculative,
        kv_cache_dtype_skip_layers=list(req.kv_cache_dtype_skip_layers),
        language_model_only=req.language_model_only,
        block_size=req.block_size,
        attention_backend=req.attention_backend,
    )
    with _cuda_target_config_check():
        return engine_args.create_engine_config()


def pad_to_max_fraction(specs: dict[str, Any]) -> float:
    largest = max(s.page_size_bytes for s in specs.values())
    real = sum(unpadded_page_size_bytes(s) for s in specs.values())
    return 1 - real / (largest * len(specs))


def check_model(req: CapacityRequest) -> None:
    """Checks the engine makes only later (at model load), or never."""
    from vllm.transformers_utils.config import get_config

    models = [(req.model, req.tensor_parallel_size, "--tensor-parallel-size")]
    if req.draft:
        # The draft runs at the main model's tensor-parallel size.
        models.append((req.draft, req.tensor_parallel_size, "--tensor-parallel-size"))
    for model, tp, flag in models:
        with _engine_step(f"reading {model}/config.json"):
            hf_config = get_config(model, trust_remote_code=False)
        text = hf_config.get_text_config()
        if model != req.model:
            flag = f"{flag} (draft model {model})"
        check_tensor_parallel(text, tp, flag)
        if model == req.model:
            check_skip_layers(req, int(getattr(text, "num_hidden_layers", 0) or 0))


def plan_capacity(req: CapacityRequest) -> CapacityReport:
    """Plan ``req`` the way the engine would at start-up, on this host."""
    import vllm
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_request(req)
    memory = available_kv_memory(req)
    capability = parse_device_capability(req.device_capability)
    # Without hybridkv's policy module this is an unpatched vLLM: its rules.
    pristine = req.pristine or not has_layer_policy()
    report = CapacityReport(
        model=req.model,
        kv_cache_dtype=req.kv_cache_dtype,
        tensor_parallel_size=req.tensor_parallel_size,
        max_model_len=req.max_model_len,
        kv_cache_memory_bytes=memory,
        vllm=vllm.__version__,
        device_capability=f"{capability[0]}.{capability[1]}",
    )
    try:
        check_model(req)
        with _engine_step("engine configuration"):
            vllm_config = engine_config(req)
        layers = all_layers(vllm_config)
        with _engine_step("block size for the hybrid page layout"):
            plan_block_size(vllm_config, layers, pristine)
        with _engine_step("KV-cache specs"):
            specs, report.layer_dtypes = kv_cache_specs(vllm_config, layers, pristine)
        report.pad_to_max_fraction = pad_to_max_fraction(specs)
        with _engine_step("KV-cache groups and pages"):
            config = get_kv_cache_configs(vllm_config, [specs], [memory])[0]
    except EngineRefusal as e:
        report.error = str(e)
        return report
    report.attention_backends, report.backend_errors = attention_backends(
        vllm_config, layers, capability, pristine
    )
    report.block_size = vllm_config.cache_config.block_size
    report.num_blocks = config.num_blocks
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, config)
    report.max_concurrency = round(concurrency, 2)
    report.kv_tokens = int(concurrency * vllm_config.model_config.max_model_len)
    padding = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        real = unpadded_page_size_bytes(spec)
        padding += (spec.page_size_bytes - real) * len(group.layer_names)
        report.page_size_bytes = spec.page_size_bytes
        report.groups.append(
            {
                "type": type(spec).__name__,
                "layers": len(group.layer_names),
                "first_layer": group.layer_names[0],
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
                "padding_bytes": spec.page_size_bytes - real,
                "dtype": str(getattr(spec, "dtype", "")),
            }
        )
    total_layers = sum(len(g.layer_names) for g in config.kv_cache_groups)
    report.padding_bytes_per_page_set = padding
    if report.page_size_bytes and total_layers:
        report.padding_fraction = padding / (report.page_size_bytes * total_layers)
    return report


def format_report(r: CapacityReport) -> str:
    head = (
        f"{r.model}  kv_cache_dtype={r.kv_cache_dtype}  TP={r.tensor_parallel_size}  "
        f"max_model_len={r.max_model_len:,}  "
        f"KV memory/GPU={r.kv_cache_memory_bytes / GIB:.2f} GiB  (vLLM {r.vllm})"
    )
    if r.error:
        cause = "\n".join("    " + line for line in r.error.splitlines())
        return f"{head}\n  FAILS at engine start-up, in\n{cause}"
    lines = [head, f"  layer KV dtypes: {r.layer_dtypes}"]
    lines.append(
        f"  {'KV cache groups':<22}{'groups':>7}{'layers':>7}{'block':>7}"
        f"{'page B':>11}{'pad B':>9}  first layer"
    )
    rows: dict[tuple, list[dict]] = {}
    for g in r.groups:
        key = (
            g["type"],
            g["block_size"],
            g["page_size_bytes"],
            g["padding_bytes"],
            g["dtype"],
        )
        rows.setdefault(key, []).append(g)
    for (kind, block, page, pad, _), groups in rows.items():
        layers = sum(g["layers"] for g in groups)
        lines.append(
            f"  {kind:<22}{len(groups):>7}{layers:>7}{block:>7}{page:>11,}"
            f"{pad:>9,}  {groups[0]['first_layer']}"
        )
    lines.append(
        f"  padding: {r.padding_bytes_per_page_set:,} B per page set = "
        f"{100 * r.padding_fraction:.2f}% of KV memory (padding every page to the "
        f"largest instead: {100 * (r.pad_to_max_fraction or 0):.2f}%)"
    )
    lines.append(
        f"  blocks: {r.num_blocks:,}   KV cache: {r.kv_tokens:,} tokens   "
        f"max concurrency at {r.max_model_len:,} tokens: {r.max_concurrency:.2f}x"
    )
    lines.append(f"  attention backends on CUDA SM {r.device_capability}:")
    for kind, backend in r.attention_backends.items():
        lines.append(f"    {kind}: {backend}")
    for kind, reason in r.backend_errors.items():
        lines.append(f"    {kind}: FAILS at engine start-up: {reason}")
    return "\n".join(lines)


if __name__ == "__main__":
    from vllm.entrypoints.cli.kv_capacity import main

    sys.exit(main())
