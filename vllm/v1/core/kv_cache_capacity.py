# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache capacity planner: what the engine would plan, without a GPU.

    vllm kv-capacity MODEL_DIR --kv-cache-dtype turboquant_4bit_nc \\
        --gpu-memory-gib 24 --weights-gib 16.6 --max-model-len 96000

(or ``python -m vllm.v1.core.kv_cache_capacity ...``).

The config goes through ``EngineArgs.create_engine_config`` (the same checks,
skip lists and cache settings as ``vllm serve``); each layer's KV-cache spec is
built by ``Attention.get_kv_cache_spec`` / ``MambaSpec`` from the layer
geometry in the HF config; block sizes come from the hybrid page planner and
the groups, page sizes and block counts from ``get_kv_cache_configs``. Given
the same KV-cache memory (``--kv-cache-memory-bytes``), the token count equals
the engine's "GPU KV cache size" line.

This module only uses APIs that upstream vLLM 0.20.2 also has, plus the
hybridkv planner when present, so it can also be run against an unpatched
install (``--pristine``) to show what 0.20.2 would do.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# CUDA's default: FlashAttention / Triton / TurboQuant accept multiples of 16.
CUDA_BLOCK_ALIGNMENT = 16
GIB = 2**30


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
    error: str | None = None
    block_size: int | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    page_size_bytes: int | None = None
    padding_bytes_per_page_set: int = 0
    padding_fraction: float = 0.0
    num_blocks: int | None = None
    kv_tokens: int | None = None
    max_concurrency: float | None = None
    layer_dtypes: dict[str, int] = field(default_factory=dict)
    pad_to_max_fraction: float | None = None
    """Padding if every page were padded to the largest, unscaled (upstream
    0.33's unification), for comparison."""


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def layer_geometry(model_config: Any, tp: int, prefix: str = "model.layers") -> list[LayerGeometry]:
    """Attention and Mamba layers of a decoder, from its HF config."""
    text = model_config.hf_text_config
    n = text.num_hidden_layers
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    types = list(types or ["full_attention"] * n)[:n]

    def per_rank(heads: int) -> int:
        return max(1, heads // tp)

    layers = []
    for i, kind in enumerate(types):
        if kind in ("linear_attention", "mamba"):
            layers.append(LayerGeometry(f"{prefix}.{i}.linear_attn", "mamba"))
        elif kind == "sliding_attention":
            layers.append(
                LayerGeometry(
                    f"{prefix}.{i}.self_attn.attn",
                    "sliding",
                    per_rank(text.num_key_value_heads),
                    text.head_dim,
                    text.sliding_window,
                )
            )
        elif getattr(text, "global_head_dim", None):
            # Gemma 4: full-attention layers have their own heads and head_dim.
            heads = getattr(text, "num_global_key_value_heads", None) or text.num_key_value_heads
            layers.append(
                LayerGeometry(f"{prefix}.{i}.self_attn.attn", "full", per_rank(heads), text.global_head_dim)
            )
        else:
            heads = model_config.get_total_num_kv_heads()
            layers.append(
                LayerGeometry(f"{prefix}.{i}.self_attn.attn", "full", per_rank(heads), model_config.get_head_size())
            )
    return layers


def mtp_layer_count(text: Any) -> int:
    return int(getattr(text, "mtp_num_hidden_layers", 0) or getattr(text, "num_nextn_predict_layers", 0) or 0)


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


def _pristine_layer_dtype(name: str, window: int | None, dtype: str, skip: list[str]) -> str:
    """vLLM 0.20.2's per-layer rule (model_executor/layers/attention/attention.py:246-262)."""
    from vllm.model_executor.models.utils import extract_layer_index

    if not skip:
        return dtype
    if window is not None and "sliding_window" in skip:
        return "auto"
    if str(extract_layer_index(name)) in skip:
        return "auto"
    return dtype


def attention_spec(vllm_config: Any, layer: LayerGeometry, pristine: bool) -> tuple[Any, str]:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType

    cache_config = vllm_config.cache_config
    dtype = cache_config.cache_dtype
    if pristine:
        dtype = _pristine_layer_dtype(
            layer.name, layer.sliding_window, dtype, list(cache_config.kv_cache_dtype_skip_layers or [])
        )
    else:
        from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
            layer_kv_cache_dtype,
        )

        dtype, _ = layer_kv_cache_dtype(
            layer.name, layer.sliding_window, dtype, cache_config, vllm_config.model_config
        )
    stand_in = SimpleNamespace(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=dtype,
        kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(dtype, vllm_config.model_config),
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
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    spec_config = vllm_config.speculative_config
    return MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
        # Only labels the group here (the page size comes from shapes/dtypes);
        # the Qwen3.5/3.6/Next layers are Gated DeltaNet.
        mamba_type="gdn_attention" if "qwen3" in model_config.hf_text_config.model_type else "mamba2",
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_speculative_blocks=spec_config.num_speculative_tokens if spec_config else 0,
    )


class _CudaKernelBlocks:
    """Stands in for the CUDA attention backend when planning on a CPU."""

    @staticmethod
    def get_supported_kernel_block_sizes():
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(CUDA_BLOCK_ALIGNMENT)]


def plan_block_size(vllm_config: Any, layers: list[LayerGeometry], pristine: bool) -> None:
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

    per_token: dict[int, int] = {}
    for layer in layers:
        if layer.kind != "mamba":
            spec, _ = attention_spec(vllm_config, layer, pristine)
            one = replace(spec, block_size=1, page_size_padded=None).page_size_bytes
            per_token[one] = per_token.get(one, 0) + 1
    mamba = replace(mamba_spec(vllm_config), page_size_padded=None)
    apply_hybrid_page_plan(
        vllm_config,
        mamba.page_size_bytes,
        max(per_token),
        max(CUDA_BLOCK_ALIGNMENT, cache_config.block_size),
        cache_config.mamba_block_size if cache_config.user_specified_mamba_block_size else None,
        per_token=per_token,
        num_mamba_layers=sum(1 for g in layers if g.kind == "mamba"),
    )


def kv_cache_specs(vllm_config: Any, layers: list[LayerGeometry], pristine: bool) -> tuple[dict, dict]:
    specs: dict[str, Any] = {}
    dtypes: dict[str, int] = {}
    mamba = mamba_spec(vllm_config) if any(g.kind == "mamba" for g in layers) else None
    for layer in layers:
        if layer.kind == "mamba":
            specs[layer.name] = mamba
            continue
        spec, dtype = attention_spec(vllm_config, layer, pristine)
        specs[layer.name] = spec
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
    return specs, dtypes


def engine_config(args: argparse.Namespace) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    speculative = None
    if args.draft:
        speculative = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    elif args.num_speculative_tokens:
        speculative = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    engine_args = EngineArgs(
        model=args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        load_format="dummy",
        speculative_config=speculative,
        kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
        language_model_only=args.language_model_only,
        block_size=args.block_size,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return engine_args.create_engine_config()
    # Planning for a CUDA run on a CPU host: the CPU backend's own limits
    # (block size 128, no FP8 KV with chunked prefill) do not apply.
    from unittest import mock

    with mock.patch.object(type(current_platform), "check_and_update_config", lambda *a: None):
        return engine_args.create_engine_config()


def available_kv_memory(args: argparse.Namespace) -> int:
    if args.kv_cache_memory_bytes:
        return args.kv_cache_memory_bytes
    if args.gpu_memory_gib is None or args.weights_gib is None:
        raise SystemExit(
            "give either --kv-cache-memory-bytes, or --gpu-memory-gib and --weights-gib "
            "(the whole model's weights; divided by the tensor-parallel size)"
        )
    per_gpu = (
        args.gpu_memory_gib * args.gpu_memory_utilization
        - args.weights_gib / args.tensor_parallel_size
        - args.overhead_gib
    )
    if per_gpu <= 0:
        raise SystemExit(f"nothing left for the KV cache: {per_gpu:.2f} GiB per GPU")
    return int(per_gpu * GIB)


def pad_to_max_fraction(specs: dict[str, Any]) -> float:
    largest = max(s.page_size_bytes for s in specs.values())
    real = sum(replace(s, page_size_padded=None).page_size_bytes for s in specs.values())
    return 1 - real / (largest * len(specs))


def has_layer_policy() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("vllm.model_executor.layers.quantization.turboquant.layer_policy")
        is not None
    )


def plan(args: argparse.Namespace) -> CapacityReport:
    import vllm
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    memory = available_kv_memory(args)
    # Without hybridkv's policy module this is an unpatched vLLM: plan with its rules.
    args.pristine = args.pristine or not has_layer_policy()
    report = CapacityReport(
        model=args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=memory,
        vllm=vllm.__version__,
    )
    try:
        vllm_config = engine_config(args)
        layers = all_layers(vllm_config)
        plan_block_size(vllm_config, layers, args.pristine)
        specs, report.layer_dtypes = kv_cache_specs(vllm_config, layers, args.pristine)
        report.pad_to_max_fraction = pad_to_max_fraction(specs)
        config = get_kv_cache_configs(vllm_config, [specs], [memory])[0]
    except Exception as e:  # the planner reports what the engine would raise
        report.error = f"{type(e).__name__}: {e}"
        return report
    report.block_size = vllm_config.cache_config.block_size
    report.num_blocks = config.num_blocks
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, config)
    report.max_concurrency = round(concurrency, 2)
    report.kv_tokens = int(concurrency * vllm_config.model_config.max_model_len)
    padding = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        real = replace(spec, page_size_padded=None).page_size_bytes if getattr(spec, "page_size_padded", None) else spec.page_size_bytes
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
        f"max_model_len={r.max_model_len:,}  KV memory/GPU={r.kv_cache_memory_bytes / GIB:.2f} GiB  (vLLM {r.vllm})"
    )
    if r.error:
        return f"{head}\n  FAILS at engine start-up: {r.error.splitlines()[0]}"
    lines = [head, f"  layer KV dtypes: {r.layer_dtypes}"]
    lines.append(f"  {'KV cache groups':<22}{'groups':>7}{'layers':>7}{'block':>7}{'page B':>11}{'pad B':>9}  first layer")
    rows: dict[tuple, list[dict]] = {}
    for g in r.groups:
        key = (g["type"], g["block_size"], g["page_size_bytes"], g["padding_bytes"], g["dtype"])
        rows.setdefault(key, []).append(g)
    for (kind, block, page, pad, _), groups in rows.items():
        lines.append(
            f"  {kind:<22}{len(groups):>7}{sum(g['layers'] for g in groups):>7}{block:>7}{page:>11,}"
            f"{pad:>9,}  {groups[0]['first_layer']}"
        )
    lines.append(
        f"  padding: {r.padding_bytes_per_page_set:,} B per page set = {100 * r.padding_fraction:.2f}% of KV memory"
        f" (padding every page to the largest instead: {100 * (r.pad_to_max_fraction or 0):.2f}%)"
    )
    lines.append(
        f"  blocks: {r.num_blocks:,}   KV cache: {r.kv_tokens:,} tokens   "
        f"max concurrency at {r.max_model_len:,} tokens: {r.max_concurrency:.2f}x"
    )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", help="model directory with config.json")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-dtype-skip-layers", nargs="*", default=[])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--draft", help="draft model directory (method draft_model); without it, MTP")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--language-model-only", action="store_true")
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV memory per GPU, as the engine's kv_cache_memory_bytes",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--weights-gib", type=float, default=None)
    p.add_argument("--overhead-gib", type=float, default=1.0, help="activations, CUDA graphs, NCCL (per GPU)")
    p.add_argument(
        "--pristine",
        action="store_true",
        help="plan with upstream 0.20.2's rules (run against an unpatched install)",
    )
    p.add_argument("--json", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = plan(args)
    print(json.dumps(asdict(report)) if args.json else format_report(report))
    return 1 if report.error else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm.v1.core.kv_cache_capacity", description=__doc__.split("\n")[0])
    return run(add_arguments(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
