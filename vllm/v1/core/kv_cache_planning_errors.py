# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks for the invariants of KV-cache planning, with errors a user can act on.

KV-cache planning (``vllm/v1/core/kv_cache_utils.py``) used bare ``assert``
statements for its invariants. When one fails at engine start-up -- typically a
new combination of layer types, KV dtypes or a draft model -- the user sees an
``AssertionError`` with no text, after minutes of weight loading. Each check
below raises :class:`KVCacheSpecError` naming the layers, their spec types and
sizes, and what to try instead.

The error classes keep the old exception types as bases, so callers that
catch ``AssertionError`` or ``NotImplementedError`` still work, and the
checks also run under ``python -O``.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

# Enough rows to see the pattern of a 60+ layer model without flooding the log.
_MAX_ROWS = 12


class KVCacheSpecError(ValueError, AssertionError):
    """The per-layer KV cache specs cannot be planned into one block pool."""


class KVCachePageSizeError(KVCacheSpecError, NotImplementedError):
    """The layers' page sizes cannot be made equal."""


def describe_spec(spec: KVCacheSpec) -> str:
    parts = [f"{type(spec).__name__}(block_size={spec.block_size}"]
    for attr in ("num_kv_heads", "head_size"):
        if hasattr(spec, attr):
            parts.append(f"{attr}={getattr(spec, attr)}")
    if hasattr(spec, "dtype"):
        parts.append(f"dtype={spec.dtype}")
    if isinstance(spec, MambaSpec):
        parts.append(f"shapes={spec.shapes}")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        parts.append(f"layers={len(spec.kv_cache_specs)}")
    padded = getattr(spec, "page_size_padded", None)
    if padded is not None:
        parts.append(f"page_size_padded={padded}")
    return ", ".join(parts) + f") page_size={spec.page_size_bytes} B"


def describe_layers(kv_cache_spec: Mapping[str, KVCacheSpec]) -> str:
    """One line per distinct spec, with the layers that use it."""
    by_spec: dict[str, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        by_spec.setdefault(describe_spec(spec), []).append(name)
    rows = []
    for desc, names in list(by_spec.items())[:_MAX_ROWS]:
        shown = ", ".join(names[:3]) + (
            f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        )
        rows.append(f"  - {desc}: {shown}")
    if len(by_spec) > _MAX_ROWS:
        rows.append(f"  - ... {len(by_spec) - _MAX_ROWS} more distinct specs")
    return "\n".join(rows)


def _bytes_per_token(spec: KVCacheSpec) -> str:
    return f"{spec.page_size_bytes // max(spec.block_size, 1)} B/token"


def page_size_not_divisible(
    layer_name: str,
    layer_spec: KVCacheSpec,
    max_page_size: int,
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> KVCachePageSizeError:
    largest = next(
        n for n, s in kv_cache_spec.items() if s.page_size_bytes == max_page_size
    )
    return KVCachePageSizeError(
        f"Cannot give all KV cache layers one page size: layer '{layer_name}' "
        f"({type(layer_spec).__name__}) has a {layer_spec.page_size_bytes} B page, "
        f"which does not divide the largest page, {max_page_size} B of layer "
        f"'{largest}' ({type(kv_cache_spec[largest]).__name__}), so no block_size "
        f"multiple of {layer_spec.block_size} makes them "
        f"equal.\nLayers:\n{describe_layers(kv_cache_spec)}\nTo try: make the layers "
        "store sizes that divide each other (the same --kv-cache-dtype for all "
        "attention layers, or exclude the mismatched layers with "
        "--kv-cache-dtype-skip-layers), or pass --disable-hybrid-kv-cache-manager for "
        "attention-only models."
    )


def check_scaled_page_size(
    layer_name: str,
    layer_spec: KVCacheSpec,
    new_spec: KVCacheSpec,
    max_page_size: int,
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> None:
    """``new_spec`` (``layer_spec`` with a larger block_size) must fill the page."""
    if new_spec.page_size_bytes == max_page_size:
        return
    largest = next(
        n for n, s in kv_cache_spec.items() if s.page_size_bytes == max_page_size
    )
    why = (
        f"{type(layer_spec).__name__}'s page size does not depend on block_size"
        if new_spec.page_size_bytes == layer_spec.page_size_bytes
        else "its page size does not grow in proportion to block_size"
    )
    hint = ""
    if isinstance(layer_spec, MambaSpec):
        # The platform already padded the Mamba page to the main model's attention
        # page; a larger attention page can only come from other layers (a draft).
        attn = {
            n: s
            for n, s in kv_cache_spec.items()
            if not isinstance(s, MambaSpec) and s.page_size_bytes == max_page_size
        }
        if attn:
            example = next(iter(attn.values()))
            hint = (
                "\nThe Mamba/linear-attention state page was sized for the main "
                f"model's attention layers, but {len(attn)} attention layer(s) such as "
                f"'{next(iter(attn))}' store {_bytes_per_token(example)} and need a "
                "larger page. This happens when a separate draft model's attention "
                "layers (KV heads x head_size x dtype) differ from the main model's."
            )
    raise KVCachePageSizeError(
        f"Cannot give all KV cache layers one page size: layer '{layer_name}' "
        f"({type(layer_spec).__name__}) has a {layer_spec.page_size_bytes} B page and "
        f"the largest page is {max_page_size} B (layer '{largest}', "
        f"{type(kv_cache_spec[largest]).__name__}). Scaling its block_size from "
        f"{layer_spec.block_size} to {new_spec.block_size} gives a "
        f"{new_spec.page_size_bytes} B page, because "
        f"{why}.{hint}\nLayers:\n{describe_layers(kv_cache_spec)}\nTo try: use the "
        "model's own MTP head as the speculator "
        '(--speculative-config \'{"method": "mtp", ...}\') or a draft whose attention '
        "layers store the same bytes per token as the main model's, use one "
        "--kv-cache-dtype for every attention layer, or disable speculative decoding."
    )


def check_uniform_page_size(specs: Iterable[KVCacheSpec], page_sizes: set[int]) -> None:
    if len(page_sizes) == 1:
        return
    specs = list(specs)
    raise KVCacheSpecError(
        "KV cache groups share one block pool and must have one page size, but found "
        f"{len(page_sizes)}: {sorted(page_sizes)} B.\nGroup specs:\n"
        + "\n".join(f"  - {describe_spec(s)}" for s in specs[:_MAX_ROWS])
        + "\nThis is a bug in KV cache grouping; please report it with the model, "
        "--kv-cache-dtype and --speculative-config used."
    )


def check_spec_types(
    specs: Mapping[str, Any], expected: type | tuple[type, ...], where: str
) -> None:
    """Every value of ``specs`` must be an instance of ``expected``."""
    wrong = {n: s for n, s in specs.items() if not isinstance(s, expected)}
    if not wrong:
        return
    names = (
        expected.__name__
        if isinstance(expected, type)
        else "/".join(t.__name__ for t in expected)
    )
    raise KVCacheSpecError(
        f"{where}: expected every layer to use {names}, but "
        f"{len(wrong)} do not:\n"
        + "\n".join(
            f"  - '{n}': {type(s).__name__}" for n, s in list(wrong.items())[:_MAX_ROWS]
        )
        + "\nThis layer mix is not supported by this KV cache layout; please report it "
        "with the model and --kv-cache-dtype used."
    )


def check_planning(
    condition: bool, what: str, kv_cache_spec: Mapping[str, KVCacheSpec]
) -> None:
    """A planning invariant with no more specific check; names the layers involved."""
    if condition:
        return
    raise KVCacheSpecError(
        "KV cache planning failed: "
        f"{what}.\nLayers:\n{describe_layers(kv_cache_spec)}\nPlease report this with "
        "the model, --kv-cache-dtype and --speculative-config used."
    )


def check_same_spec_across_workers(
    layer_name: str, first: KVCacheSpec, other: KVCacheSpec
) -> None:
    if first == other:
        return
    raise KVCacheSpecError(
        f"Layer '{layer_name}' has different KV cache specs on different workers: "
        f"{describe_spec(first)} vs {describe_spec(other)}. All workers of a layer "
        "must agree; check that every rank runs the same model, --kv-cache-dtype and "
        "tensor-parallel layout."
    )


def check_all_layers_grouped(
    groups: list[Any], kv_cache_spec: Mapping[str, KVCacheSpec]
) -> None:
    grouped = {n for g in groups for n in g.layer_names}
    missing = [n for n in kv_cache_spec if n not in grouped]
    if sum(len(g.layer_names) for g in groups) == len(kv_cache_spec):
        return
    raise KVCacheSpecError(
        f"{len(missing)} layer(s) were not assigned to any KV cache group: "
        f"{missing[:_MAX_ROWS]} (groups hold {sum(len(g.layer_names) for g in groups)} "
        f"layer slots for {len(kv_cache_spec)} layers). Please report this with the "
        "model and pipeline-parallel size used."
    )


def check_same_num_blocks(kv_cache_configs: list[Any]) -> None:
    counts = [c.num_blocks for c in kv_cache_configs]
    if len(set(counts)) <= 1:
        return
    raise KVCacheSpecError(
        f"Workers planned different numbers of KV cache blocks: {counts} (by rank). "
        "The scheduler needs one count; this is a bug in get_kv_cache_configs."
    )


def check_tensor_divisible(tensor: Any, num_blocks: int) -> None:
    if tensor.size % num_blocks == 0:
        return
    raise KVCacheSpecError(
        f"KV cache tensor shared by {tensor.shared_by[:_MAX_ROWS]} has {tensor.size} "
        f"B, which is not a whole number of its {num_blocks} blocks; it cannot be "
        "shrunk to match the other workers. Please report this with the model and "
        "parallel sizes."
    )
