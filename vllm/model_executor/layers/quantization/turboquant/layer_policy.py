# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which attention layers store their KV cache in the quantized dtype.

``--kv-cache-dtype-skip-layers`` lists layers kept at the model dtype. Its
entries are:

- a decimal layer index of the main model (``"63"``);
- ``sliding_window``: every sliding-window layer;
- ``sliding_window=DTYPE``: in a TurboQuant run, every sliding-window layer
  stores one of vLLM's 8-bit caches instead of the model dtype: ``fp8``
  (e4m3 with per-tensor scales, as ``--kv-cache-dtype fp8`` takes them) or
  ``int8_per_token_head`` / ``fp8_per_token_head`` (a scale per token and
  head);
- ``draft``: every layer of a speculative drafter (MTP head, EAGLE head or
  separate draft model);
- ``boundary:N``: TurboQuant's boundary protection, the first ``N`` and last
  ``N`` *attention* layers of the main model;
- ``N=PRESET``: main-model attention layer ``N`` stores another TurboQuant
  preset than the run's (``19=turboquant_4bit_nc`` in a
  ``turboquant_3bit_nc`` run): a budget of bits spent where a model's
  quantization error costs the most;
- ``recent:W``: every TurboQuant layer of the main model also keeps its
  ``W`` most recent tokens at the model dtype, and decode steps read them
  from there (``turboquant.raw_window``).

Policy for TurboQuant (``turboquant_*``), decided once in
``resolve_skip_layers`` and applied per layer by ``layer_kv_cache_dtype``:

- Boundary protection counts attention layers, not decoder layers: in a
  Qwen3.5/3.6 hybrid, decoder layers 0, 1 and 62 are Gated DeltaNet layers
  that have no KV cache, so upstream's "skip layers 0, 1, 62, 63" protected
  one attention layer. Default ``N`` is 2 for models whose layers are all
  attention (upstream behaviour unchanged) and 0 for Mamba/GDN hybrids
  (as upstream 0.33 does): there only every fourth layer is attention, each
  bf16 layer costs four TurboQuant layers of memory, and the first/last
  decoder layers the rule was meant to protect are GDN layers TurboQuant
  never touches. ``boundary:N`` overrides the default either way.
- Drafter layers are never matched by a layer index: ``mtp.layers.0`` and
  ``draft_model.model.layers.0`` used to alias the main model's layer 0.
  They use the run's KV dtype unless ``draft`` is listed; a drafter's
  quantization error can only lower the acceptance rate, never change the
  verified output.
- Sliding-window layers are never TurboQuant layers: TurboQuant has no
  sliding-window kernel and no sliding-window KV spec (a TurboQuant sliding
  layer was sized as an unpacked uint8 cache and attended over all tokens).
  They keep the model dtype (``sliding_window`` is added with one log line),
  or with ``sliding_window=DTYPE`` store that 8-bit dtype through the
  attention backend vLLM picks for it. That halves what they hold, which is most of
  the cache where few layers are full attention and contexts are short next
  to the window times the sliding layers (Gemma 3 and 4: 5 of 6 layers slide).
  A layer index or ``draft`` still keeps a sliding layer at the model dtype.

Every layer's decision is recorded, and the resulting map is logged once,
compactly, after the model (and drafter) are built.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

logger = init_logger(__name__)

SLIDING_WINDOW = "sliding_window"
# What ``sliding_window=DTYPE`` may give sliding-window layers, under the
# names --kv-cache-dtype takes: the FP8 cache FlashAttention and Triton
# attention read (both cast the query to FP8 for it on CUDA), and the
# per-token-head caches Triton attention reads with the query unquantized.
SLIDING_WINDOW_DTYPES = ("fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head")
DRAFT = "draft"
BOUNDARY_PREFIX = "boundary:"
PRESET_SEPARATOR = "="
RECENT_PREFIX = "recent:"
# The decode reads a window in one tile of registers per (row, KV head).
MAX_RECENT_TOKENS = 64
DEFAULT_BOUNDARY_DENSE = 2
DEFAULT_BOUNDARY_HYBRID = 0

_ATTENTION_TYPES = {"full_attention", "attention", "sliding_attention"}
_SLIDING_TYPES = {"sliding_attention"}


@dataclass(frozen=True)
class LayerDecision:
    kv_cache_dtype: str
    reason: str


# prefix -> decision, filled while layers are built; logged once.
_DECISIONS: dict[str, LayerDecision] = {}
_LOGGED = False


def attention_layer_indices(hf_text_config) -> list[int]:
    """Decoder-layer indices of the main model that are attention layers."""
    num_layers = hf_text_config.num_hidden_layers
    for field in ("layer_types", "layers_block_type"):
        types = getattr(hf_text_config, field, None)
        if types:
            return [
                i for i, t in enumerate(types[:num_layers]) if t in _ATTENTION_TYPES
            ]
    return list(range(num_layers))


def sliding_layer_indices(hf_text_config) -> set[int]:
    """Main-model layers with a sliding window (every layer when the model has
    one window and no per-layer types)."""
    types = getattr(hf_text_config, "layer_types", None)
    if not types:
        if getattr(hf_text_config, "sliding_window", None) is None:
            return set()
        return set(range(hf_text_config.num_hidden_layers))
    return {i for i, t in enumerate(types) if t in _SLIDING_TYPES}


def boundary_layers(
    skip_layers: list[str], attention_layers: list[int], hybrid: bool
) -> tuple[int, list[int]]:
    """(N, the attention-layer indices boundary protection keeps)."""
    requested = [s for s in skip_layers if s.startswith(BOUNDARY_PREFIX)]
    if requested:
        value = requested[-1][len(BOUNDARY_PREFIX) :]
        if not value.isdigit():
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {requested[-1]!r}: expected "
                f"'{BOUNDARY_PREFIX}N' with N a whole number of attention layers "
                f"(e.g. '{BOUNDARY_PREFIX}1'; '{BOUNDARY_PREFIX}0' turns boundary "
                "protection off)."
            )
        n = int(value)
    else:
        n = DEFAULT_BOUNDARY_HYBRID if hybrid else DEFAULT_BOUNDARY_DENSE
    if n == 0:
        return 0, []
    kept = attention_layers[:n] + attention_layers[-n:]
    return n, sorted(set(kept))


def recent_window(skip_layers: list[str] | None) -> int:
    """W of a ``recent:W`` entry (checked by ``resolve_skip_layers``), else 0."""
    entries = [s for s in skip_layers or [] if s.startswith(RECENT_PREFIX)]
    if not entries:
        return 0
    value = entries[-1][len(RECENT_PREFIX) :]
    if not value.isdigit() or not 1 <= int(value) <= MAX_RECENT_TOKENS:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers entry {entries[-1]!r}: expected "
            f"'{RECENT_PREFIX}W' with W a whole number of tokens from 1 to "
            f"{MAX_RECENT_TOKENS} (e.g. '{RECENT_PREFIX}16')."
        )
    return int(value)


_SLIDING_DTYPE_PREFIX = SLIDING_WINDOW + PRESET_SEPARATOR


def _sliding_window_dtypes(skip_layers: list[str] | None) -> list[str]:
    """The DTYPEs of the ``sliding_window=DTYPE`` entries, in order."""
    prefix = _SLIDING_DTYPE_PREFIX
    return [s[len(prefix) :] for s in skip_layers or [] if s.startswith(prefix)]


def sliding_window_dtype(skip_layers: list[str] | None) -> str | None:
    """DTYPE of a ``sliding_window=DTYPE`` entry (checked by
    ``resolve_skip_layers``), else None."""
    dtypes = _sliding_window_dtypes(skip_layers)
    return dtypes[-1] if dtypes else None


def _check_sliding_window_dtype(skip: list[str], sliding: set[int], model: str) -> None:
    prefix = _SLIDING_DTYPE_PREFIX
    dtypes = _sliding_window_dtypes(skip)
    if not dtypes:
        return
    entries = [prefix + dtype for dtype in dtypes]
    allowed = ", ".join(SLIDING_WINDOW_DTYPES[:-1]) + " or " + SLIDING_WINDOW_DTYPES[-1]
    for entry, dtype in zip(entries, dtypes):
        if dtype not in SLIDING_WINDOW_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r}: sliding-window "
                f"layers of a TurboQuant run can store {allowed} (vLLM's 8-bit "
                "caches with a sliding-window kernel) instead of the model dtype; "
                "TurboQuant itself has no sliding-window kernel. Give "
                f"'{prefix}fp8' or '{prefix}int8_per_token_head', or leave the "
                "entry out to keep them at the model dtype."
            )
    if len(set(entries)) > 1:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers gives sliding-window layers two KV "
            f"dtypes ({', '.join(sorted(set(entries)))}). Keep one of them."
        )
    if SLIDING_WINDOW in skip:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers entries {SLIDING_WINDOW!r} and "
            f"{entries[-1]!r} give sliding-window layers two KV dtypes (the model "
            f"dtype, and {dtypes[-1]}). Keep one of them."
        )
    if not sliding:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers entry {entries[-1]!r}: model {model!r} "
            "has no sliding-window layers, so the entry would change nothing. "
            "Leave it out."
        )


def _sort_key(entry: str) -> tuple[int, int, str]:
    index, _, preset = entry.partition(PRESET_SEPARATOR)
    return (0, int(index), preset) if index.isdigit() else (1, 0, entry)


def layer_presets(skip_layers: list[str]) -> dict[int, str]:
    """Main-model layer index -> its own TurboQuant preset (``N=PRESET``
    entries, checked by ``resolve_skip_layers``)."""
    presets = {}
    for entry in skip_layers:
        index, sep, preset = entry.partition(PRESET_SEPARATOR)
        if sep and index.isdigit():
            presets[int(index)] = preset
    return presets


def _check_layer_presets(
    skip: list[str],
    attention: list[int],
    sliding: set[int],
    boundary: tuple[int, list[int]],
) -> None:
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TQ_PRESETS,
    )

    seen: dict[int, str] = {}
    for entry in skip:
        index, sep, preset = entry.partition(PRESET_SEPARATOR)
        if not sep or index == SLIDING_WINDOW:
            continue
        if not index.isdigit() or preset not in TQ_PRESETS:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r}: expected "
                f"'N{PRESET_SEPARATOR}PRESET', N a main-model attention layer and "
                f"PRESET one of {sorted(TQ_PRESETS)} (e.g. "
                f"'{attention[0]}{PRESET_SEPARATOR}turboquant_4bit_nc')."
            )
        layer = int(index)
        if layer not in attention:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r}: layer {layer} has "
                "no KV cache (a GDN/Mamba layer, or past the model's layers). The "
                f"model's attention layers are {attention}: give one of those."
            )
        if layer in sliding:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r}: layer {layer} is a "
                "sliding-window layer, which TurboQuant keeps at the model dtype "
                "(it has no sliding-window kernel). Give a full-attention layer."
            )
        if index in skip:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entries {index!r} and {entry!r} give "
                f"layer {layer} two KV dtypes (the model dtype, and {preset}). "
                "Keep one of them."
            )
        if layer in seen and seen[layer] != preset:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers gives layer {layer} two presets "
                f"({seen[layer]} and {preset}). Keep one of them."
            )
        seen[layer] = preset
        n, kept = boundary
        if layer in kept:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r}: layer {layer} is "
                f"kept at the model dtype by boundary protection "
                f"({BOUNDARY_PREFIX}{n}, the first and last {n} attention layers). "
                f"Give {BOUNDARY_PREFIX}0 (or a smaller N), or another layer."
            )


def resolve_skip_layers(
    model_config: "ModelConfig", cache_config: "CacheConfig"
) -> list[str]:
    """The skip list for a TurboQuant run (replaces upstream's hybrid refusal
    and global-index boundary rule in ``EngineArgs.create_engine_config``)."""
    text_config = model_config.hf_text_config
    skip = list(cache_config.kv_cache_dtype_skip_layers or [])
    for entry in skip:
        if not (
            entry.isdigit()
            or entry in (SLIDING_WINDOW, DRAFT)
            or entry.startswith((BOUNDARY_PREFIX, RECENT_PREFIX))
            or PRESET_SEPARATOR in entry
        ):
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry!r} is not understood: "
                f"expected a layer index, '{SLIDING_WINDOW}', "
                f"'{SLIDING_WINDOW}{PRESET_SEPARATOR}DTYPE', '{DRAFT}', "
                f"'{BOUNDARY_PREFIX}N', 'N{PRESET_SEPARATOR}PRESET' or "
                f"'{RECENT_PREFIX}W'."
            )
        if entry.isdigit() and int(entry) >= text_config.num_hidden_layers:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers entry {entry}: model "
                f"{model_config.model!r} has {text_config.num_hidden_layers} layers "
                f"(indices 0-{text_config.num_hidden_layers - 1}), so it would skip "
                "nothing. Give an index in range."
            )
    recent_window(skip)
    attention = attention_layer_indices(text_config)
    if not attention:
        raise ValueError(
            f"--kv-cache-dtype {cache_config.cache_dtype}: model "
            f"{model_config.model!r} has no attention layers, so TurboQuant has "
            "nothing to quantize. Use --kv-cache-dtype auto."
        )
    n, kept = boundary_layers(skip, attention, model_config.is_hybrid)
    sliding = sliding_layer_indices(text_config)
    _check_layer_presets(skip, attention, sliding, (n, kept))
    _check_sliding_window_dtype(skip, sliding, model_config.model)
    merged = set(skip) | {str(i) for i in kept}
    sliding_dtype = sliding_window_dtype(skip)
    if sliding and sliding_dtype is not None:
        logger.info(
            "TurboQuant has no sliding-window kernel: sliding-window layers store "
            "%s (%s%s%s).",
            sliding_dtype,
            SLIDING_WINDOW,
            PRESET_SEPARATOR,
            sliding_dtype,
        )
    elif sliding and SLIDING_WINDOW not in merged:
        merged.add(SLIDING_WINDOW)
        logger.info(
            "TurboQuant has no sliding-window kernel: sliding-window layers keep "
            "the model's KV dtype (%s added to --kv-cache-dtype-skip-layers; "
            "%s%sfp8 or int8_per_token_head stores them in 8 bits).",
            SLIDING_WINDOW,
            SLIDING_WINDOW,
            PRESET_SEPARATOR,
        )
    logger.info(
        "TurboQuant: %d of %d attention layers kept at the model dtype by "
        "boundary protection (%s%d, counted in attention layers): %s",
        len(kept),
        len(attention),
        BOUNDARY_PREFIX,
        n,
        kept,
    )
    return sorted(merged, key=_sort_key)


def is_draft_layer(prefix: str, num_main_layers: int | None) -> bool:
    """Whether ``prefix`` names an attention layer of a speculative drafter."""
    parts = prefix.split(".")
    if parts[0] == "draft_model" or "mtp" in parts:
        return True
    if num_main_layers is None:
        return False
    indices = [int(p) for p in parts if p.isdigit()]
    # EAGLE heads continue the target's numbering (model.layers.<N + i>).
    return bool(indices) and indices[0] >= num_main_layers


def layer_kv_cache_dtype(
    prefix: str,
    sliding_window: int | None,
    kv_cache_dtype: str,
    cache_config: "CacheConfig",
    model_config: "ModelConfig | None",
) -> tuple[str, str]:
    """(the KV dtype of the attention layer ``prefix``, why)."""
    skip_layers = list(cache_config.kv_cache_dtype_skip_layers or [])
    num_main_layers = (
        model_config.hf_text_config.num_hidden_layers
        if model_config is not None
        else None
    )
    quantized = kv_cache_dtype.startswith("turboquant_")
    presets = layer_presets(skip_layers)
    sliding_dtype = sliding_window_dtype(skip_layers)
    if sliding_dtype is not None and not quantized:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers {SLIDING_WINDOW}{PRESET_SEPARATOR}"
            f"{sliding_dtype} gives a TurboQuant run's sliding-window layers "
            f"{sliding_dtype}, but the KV cache dtype is {kv_cache_dtype!r}. Give a "
            f"--kv-cache-dtype turboquant_* (or --kv-cache-dtype {sliding_dtype} for "
            "it on every layer), or leave the entry out."
        )
    if recent_window(skip_layers) and not quantized:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers {RECENT_PREFIX}"
            f"{recent_window(skip_layers)} keeps a TurboQuant layer's recent tokens "
            f"at the model dtype, but the KV cache dtype is {kv_cache_dtype!r}. "
            "Give a --kv-cache-dtype turboquant_* or leave the entry out."
        )
    if presets and not quantized:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers gives layers {sorted(presets)} their own "
            f"TurboQuant preset, but the KV cache dtype is {kv_cache_dtype!r}: a "
            "layer's preset replaces the run's TurboQuant preset. Give a "
            "--kv-cache-dtype turboquant_* or leave those entries out."
        )
    draft = is_draft_layer(prefix, num_main_layers)
    index = None if draft else _layer_index(prefix)
    decision = LayerDecision(kv_cache_dtype, "draft layer" if draft else "")
    if draft and DRAFT in skip_layers:
        decision = LayerDecision("auto", DRAFT)
    elif index is not None and str(index) in skip_layers:
        decision = LayerDecision("auto", f"layer {index} in skip list")
    elif sliding_window is not None and sliding_dtype is not None:
        decision = LayerDecision(
            sliding_dtype, f"{SLIDING_WINDOW}{PRESET_SEPARATOR}{sliding_dtype}"
        )
    elif sliding_window is not None and (SLIDING_WINDOW in skip_layers or quantized):
        decision = LayerDecision("auto", SLIDING_WINDOW)
    elif index is not None and index in presets:
        decision = LayerDecision(presets[index], f"layer {index}'s own preset")
    _DECISIONS[prefix] = decision
    return decision.kv_cache_dtype, decision.reason


def _layer_index(prefix: str) -> int | None:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(prefix)
    except (AssertionError, ValueError):
        return None


def log_kv_cache_dtype_map(vllm_config: "VllmConfig") -> None:
    """Log, once per process, which attention layers got which KV dtype."""
    global _LOGGED
    if _LOGGED or not _DECISIONS:
        return
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto" and all(
        d.kv_cache_dtype == "auto" for d in _DECISIONS.values()
    ):
        return
    _LOGGED = True
    by_dtype: dict[str, list[str]] = defaultdict(list)
    for prefix, decision in _DECISIONS.items():
        label = decision.kv_cache_dtype
        if decision.kv_cache_dtype == "auto":
            label = f"auto ({vllm_config.model_config.dtype})"
        if decision.reason:
            label += f" [{decision.reason}]"
        by_dtype[label].append(_short(prefix))
    lines = [
        f"  {label}: {len(names)} layer(s): {', '.join(names)}"
        for label, names in by_dtype.items()
    ]
    logger.info("KV cache dtype per attention layer:\n%s", "\n".join(lines))


def _short(prefix: str) -> str:
    for suffix in (".self_attn.attn", ".attn.attn", ".attn"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix
