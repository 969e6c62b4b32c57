# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache capacity planner: what the engine would plan, without a GPU.

``plan_capacity(CapacityRequest(...))`` returns a :class:`CapacityReport`;
``vllm kv-capacity`` (vllm/entrypoints/cli/kv_capacity.py) is its command line.
Both run on any host: without a GPU, the planner plans for CUDA on vLLM's CPU
platform (``use_planning_platform``), which ``plan_capacity`` sets up itself.

The config goes through ``EngineArgs.create_engine_config`` (the same checks,
skip lists, cache settings and scheduler defaults as ``vllm serve``); each
layer's KV-cache spec is built by ``Attention.get_kv_cache_spec`` /
``MambaSpec`` from the layer geometry in the HF config; block sizes come from
the hybrid page planner and the groups, page sizes and block counts from
``get_kv_cache_configs``. Given the same KV-cache memory
(``kv_cache_memory_bytes``), the token count equals the engine's "GPU KV cache
size" line. The attention backend of each layer kind is what CUDA's own
selection answers for the requested compute capability.

Inputs the engine would refuse later (at model load, or never: a value that
describes no GPU, a geometry no model has, an option that would change
nothing) raise :class:`CapacityInputError` naming the ``CapacityRequest``
field and its value, the rule and the fix; a model file that exists but
cannot be read raises :class:`CapacityReadError`. Errors, warnings and the
report's texts name request fields (in running text in backquotes,
`kv_cache_memory_bytes`), never command-line options; ``vllm kv-capacity``
puts its options in their place. A configuration the engine refuses during planning
is a report with ``error`` set; any other exception is a bug of the planner
and propagates.

The rules of the hybridkv series' engine modules are called, not repeated:
the page padding model (``kv_cache_page_unify``), the hybrid block size
(``kv_cache_page_planner``), the per-layer KV dtype and skip list
(TurboQuant's ``layer_policy``) and the per-layer attention shapes of
transformers >= 5.15 configs (``per_layer_config``), where this vLLM has them
(``engine_module``). Without them the planner applies vLLM 0.20.2's rule, as
the engine does there: an unpatched install (the module imports only APIs
upstream 0.20.2 also has, so it can be loaded against one) or a place in the
hybridkv series before the patch that adds the module. ``pristine=True`` asks
for 0.20.2's rules and is refused on a patched install, whose engine code
plans with the series' rules (a mix of both would plan what neither does).
"""

import builtins
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger("vllm.v1.core.kv_cache_capacity")

# CUDA's default: FlashAttention / Triton / TurboQuant accept multiples of 16.
CUDA_BLOCK_ALIGNMENT = 16
GIB = 2**30
DEFAULT_DEVICE_CAPABILITY = "9.0"
DEFAULT_OVERHEAD_GIB = 1.0
# Whose defaults the engine takes (vLLM's UsageContext): `vllm serve` or the
# Python LLM class; they differ in max_num_batched_tokens.
USAGE_CONTEXTS = {"serve": "OPENAI_API_SERVER", "llm": "LLM_CLASS"}

# Exceptions the engine raises when it refuses a configuration while planning
# (config validation, skip-list rules, page unification, 0.20.2's bare asserts).
ENGINE_REFUSALS = (ValueError, AssertionError, NotImplementedError)

# The engine modules whose rules the planner calls (``engine_module``): the
# page padding model and the hybrid block size (hybridkv 0004), the per-layer
# KV dtype and skip list (0005), per-layer attention shapes (0010).
PAGE_UNIFY = "vllm.v1.core.kv_cache_page_unify"
PAGE_PLANNER = "vllm.v1.core.kv_cache_page_planner"
LAYER_POLICY = "vllm.model_executor.layers.quantization.turboquant.layer_policy"
RAW_WINDOW = "vllm.model_executor.layers.quantization.turboquant.raw_window"
PER_LAYER_CONFIG = "vllm.transformers_utils.per_layer_config"

# The hybridkv series' engine modules that change planning (0001, 0004, 0005,
# 0009). Present: a patched install, whose plans follow the series' rules.
SERIES_PLANNING_MODULES = (
    "vllm.v1.core.kv_cache_planning_errors",
    PAGE_UNIFY,
    LAYER_POLICY,
    "vllm.v1.core.kv_cache_draft_groups",
)


class CapacityInputError(ValueError):
    """A planner input that the engine would refuse, or that describes no GPU
    or no model. ``vllm kv-capacity`` exits with ``exit_status``.

    ``field`` is the ``CapacityRequest`` field at fault (None where no single
    field is) and ``value`` its value, or the entry at fault of a sequence;
    ``body`` says what is wrong, the rule and the fix, naming other fields in
    backquotes. ``str()`` is ``field=value: body``.
    """

    exit_status = 2
    kind = "input"

    def __init__(self, body: str, field: str | None = None, value: Any = None):
        self.body = body
        self.field = field
        self.value = value
        super().__init__(body if field is None else f"{field}={value!r}: {body}")


class CapacityReadError(CapacityInputError):
    """A model file that exists but cannot be read (permissions, I/O)."""

    exit_status = 3
    kind = "unreadable"


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
    """One GPU's memory. With ``kv_cache_memory_bytes`` it only picks the
    engine's scheduler defaults, which depend on it."""
    gpu_memory_utilization: float | None = None
    """None: the engine's default (``EngineArgs.gpu_memory_utilization``)."""
    weights_gib: float | None = None
    overhead_gib: float | None = None
    """None: ``DEFAULT_OVERHEAD_GIB``."""
    device_capability: str = DEFAULT_DEVICE_CAPABILITY
    """CUDA compute capability the backends are chosen for, e.g. 9.0 or 12.0."""
    pristine: bool = False
    max_num_batched_tokens: int | None = None
    """None: the engine's default for the GPU (``gpu_memory_gib``,
    ``device_capability``) and ``usage_context``."""
    usage_context: str = "serve"
    """Whose defaults: "serve" (`vllm serve`) or "llm" (the LLM class)."""
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    enable_prefix_caching: bool | None = None
    """None: the engine's default for the model (vLLM 0.20.2: on for
    attention-only models, off for GDN/Mamba hybrids)."""
    mamba_cache_mode: str | None = None
    """Which GDN/Mamba states prefix caching keeps (vLLM's ``MambaCacheMode``):
    "all" (the state at every block boundary) or "align" (where a scheduler
    step ends on one); only with prefix caching on. None: vLLM's choice."""


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
    usage_context: str = "serve"
    max_num_batched_tokens: int | None = None
    """What the engine schedules per step (sliding-window layers hold
    window - 1 + this many tokens per request)."""
    max_num_batched_tokens_source: str = ""
    """Where it comes from: the request field in backquotes, or whose default."""
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    """Prefix caching in the engine config: as asked, or the engine's
    default for the model."""
    prefix_caching_source: str = ""
    mamba_cache_mode: str | None = None
    """The Mamba cache mode the engine config ends with, after vLLM's own
    fallbacks (e.g. "all" -> "align"); "none" without prefix caching."""
    mamba_block_size: int | None = None
    """Tokens per GDN/Mamba state block: the attention block size with prefix
    caching on, max_model_len without; None for a model without GDN/Mamba
    layers."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """One entry per KV-cache group: its spec type, layers, empty layer slots
    (``padding_layers``) and ``layer_pages``, one row per kind of layer in it,
    whose ``page_size_bytes`` / ``padding_bytes`` are one block of ONE layer
    (for every spec type). The group's own ``page_size_bytes`` is that too,
    or None where its layers differ (UniformTypeKVCacheSpecs)."""
    page_size_bytes: int | None = None
    """The page of one layer, where every layer has the same (hybrid models)."""
    padding_bytes_per_page_set: int = 0
    """Bytes of one block of every group that hold no layer's data: page
    padding plus the page slots of padding layers."""
    padding_fraction: float = 0.0
    """Share of KV-cache memory that holds no data, page padding plus padding
    layers, with every group holding the same number of blocks (the engine's
    model: kv_cache_page_unify's PagePadding, and a block of a group spans
    every tensor with a page for it)."""
    padding_fraction_full_load: float = 0.0
    """The same share with the cache full of ``max_model_len`` requests: each
    group's empty page slots weighted by the blocks such a request holds in
    it (the per-group counts vLLM's max concurrency takes). An empty slot
    wastes memory only in blocks its group holds, and a GDN/Mamba group holds
    a few blocks per request where an attention group holds one per
    ``block_size`` tokens; ``padding_fraction`` weighs every group alike,
    which short requests approach."""
    padding_layers: int = 0
    """Empty layer slots of the groups, the engine's "Add N padding layers"."""
    padding_warnings: list[str] = field(default_factory=list)
    """The engine's own padding warning for each spec type that gets padding
    layers (the same N and "may waste at most" figure it logs)."""
    num_blocks: int | None = None
    tensor_pages: dict[int, int] = field(default_factory=dict)
    """Pages a KV-cache tensor holds -> how many tensors hold that many. A
    tensor shorter than ``num_blocks`` pages holds only the block ids below
    its length, which only the groups of the layers sharing it take."""
    kv_tokens: int | None = None
    max_concurrency: float | None = None
    layer_dtypes: dict[str, int] = field(default_factory=dict)
    attention_backends: dict[str, str] = field(default_factory=dict)
    """Layer kind -> the backend CUDA's selection picks for it."""
    backend_errors: dict[str, str] = field(default_factory=dict)
    """Layer kind -> why no backend would serve it (the engine fails to start)."""
    pad_to_max_fraction: float | None = None
    """Page padding if every page were padded to the largest, unscaled
    (upstream 0.33's unification), for comparison; None where the engine
    does not unify pages (one group of one spec type)."""
    warnings: list[str] = field(default_factory=list)
    """Inputs that are taken but change nothing in the plan; request fields
    in backquotes (`weights_gib`)."""

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

# Counts and sizes of a decoder's layers, as config.json names them: each one
# present must be a whole number >= 1 (the engine sizes tensors and splits
# heads by them).
_GEOMETRY = (
    ("num_hidden_layers", "decoder layers"),
    ("hidden_size", "hidden size"),
    ("num_attention_heads", "query heads"),
    ("num_key_value_heads", "KV heads"),
    ("head_dim", "attention head size"),
    ("global_head_dim", "full-attention head size"),
    ("num_global_key_value_heads", "full-attention KV heads"),
    ("linear_num_key_heads", "linear-attention (GDN) key heads"),
    ("linear_num_value_heads", "linear-attention (GDN) value heads"),
    ("linear_key_head_dim", "linear-attention (GDN) key head size"),
    ("linear_value_head_dim", "linear-attention (GDN) value head size"),
    ("linear_conv_kernel_dim", "linear-attention (GDN) convolution width"),
    ("mamba_n_heads", "Mamba heads"),
    ("mamba_d_head", "Mamba head size"),
    ("mamba_n_groups", "Mamba groups"),
    ("mamba_d_state", "Mamba state size"),
    ("mamba_d_conv", "Mamba convolution width"),
)
# Counts that may be 0 (a model without an MTP head).
_COUNTS_OR_ZERO = (
    ("mtp_num_hidden_layers", "MTP layers"),
    ("num_nextn_predict_layers", "MTP layers"),
)
_GEOMETRY_RULE = (
    "The engine builds each attention layer with an equal group of query heads "
    "per KV head (its Attention layer asserts num_heads % num_kv_heads == 0) "
    "and sizes every tensor by these counts, each a whole number of at least "
    "1; it would stop at model load."
)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_problems(
    attr: str, what: str, values: list[Any], least: int = 1
) -> list[str]:
    problems = []
    for value in values:
        if value is None:
            continue
        if not _is_count(value):
            problems.append(
                f"{attr}={value!r} ({what}) is a {type(value).__name__}, not a "
                "whole number (write it without quotes or decimals)"
            )
        elif value < least:
            problems.append(f"{attr}={value} ({what}) must be at least {least}")
    return problems


def _all_count_problems(get: Any) -> list[str]:
    """Every count of ``_GEOMETRY`` / ``_COUNTS_OR_ZERO``, ``get(attr)``
    giving the list of its values."""
    problems = []
    for attr, what in _GEOMETRY:
        problems += _count_problems(attr, what, get(attr))
    for attr, what in _COUNTS_OR_ZERO:
        problems += _count_problems(attr, what, get(attr), least=0)
    return problems


def _geometry_error(field: str, value: str, problems: list[str]) -> CapacityInputError:
    return CapacityInputError(
        "its config.json describes a model the engine cannot build: "
        + "; ".join(problems)
        + f". {_GEOMETRY_RULE} Fix the value in config.json, or fetch the "
        "model's config.json again.",
        field,
        value,
    )


def _raw_geometry(field: str, value: str, parsed: dict) -> None:
    """Counts in config.json as written: transformers passes some bad ones
    through and fails on others with a traceback of its own."""
    problems = []
    sections = [parsed]
    if isinstance(parsed.get("text_config"), dict):
        sections.append(parsed["text_config"])
    for section in sections:
        problems += _all_count_problems(lambda attr, s=section: [s.get(attr)])
    if problems:
        raise _geometry_error(field, value, problems)


def _model_dir(field: str, value: str) -> None:
    try:
        _read_model_dir(field, value)
    except OSError as e:
        # Permissions or I/O: the file is there, this user cannot read it.
        what = e.filename or f"{value}/config.json"
        raise CapacityReadError(
            f"cannot read {what}: {e.strerror or e}. Make the directory and its "
            "config.json readable by this user, or fetch the model's config.json "
            "again.",
            field,
            value,
        ) from e


def _read_model_dir(field: str, value: str) -> None:
    path = Path(value)
    if not path.is_dir():
        raise CapacityInputError(
            "no such directory. kv-capacity reads the model's config.json from a "
            "local directory (no download); fetch it with "
            f"`hf download <repo id> config.json --local-dir {value}`.",
            field,
            value,
        )
    config = path / "config.json"
    if not config.is_file():
        raise CapacityInputError(
            "the directory has no config.json. Point it at the model directory "
            "(the one holding config.json).",
            field,
            value,
        )
    # transformers' own error for it is a traceback, raised inside the planner.
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CapacityInputError(
            f"its config.json is not valid JSON ({e}). Fetch the model's "
            "config.json again.",
            field,
            value,
        ) from e
    if not isinstance(parsed, dict):
        raise CapacityInputError(
            f"its config.json holds a JSON {type(parsed).__name__}, expected an "
            "object of the model's settings. Fetch the model's config.json again.",
            field,
            value,
        )
    _raw_geometry(field, value, parsed)


def _positive(field: str, value: float | None, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise CapacityInputError(f"must be a finite number. {fix}", field, value)
    if not value > 0:
        raise CapacityInputError(f"must be greater than 0. {fix}", field, value)


def parse_device_capability(value: str) -> tuple[int, int]:
    text = value.strip().lower().removeprefix("sm_").removeprefix("sm")
    major, dot, minor = text.partition(".")
    if not dot and text.isdigit() and len(text) >= 2:
        major, minor = text[:-1], text[-1]
    # CUDA minor versions are one digit (8.9, 12.1).
    if not (major.isdigit() and minor.isdigit() and len(minor) == 1):
        raise CapacityInputError(
            "expected a CUDA compute capability MAJOR.MINOR, e.g. 8.9 (L4/RTX 40), "
            "9.0 (H100) or 12.0 (RTX 50).",
            "device_capability",
            value,
        )
    return int(major), int(minor)


def _torch_cuda_archs() -> list[tuple[str, int, int]] | None:
    """The GPU code torch was built with ("sm"/"compute", major, minor): the
    kernels vLLM runs on CUDA. None for a torch without CUDA."""
    import torch

    arch_flags = getattr(torch._C, "_cuda_getArchFlags", None)
    text = arch_flags() if arch_flags is not None else None
    archs = []
    for flag in (text or "").split():
        kind, _, number = flag.partition("_")
        digits = re.match(r"\d+", number)
        if kind in ("sm", "compute") and digits:
            major, minor = divmod(int(digits.group()), 10)
            archs.append((kind, major, minor))
    return archs or None


def check_device_capability(value: str) -> list[str]:
    """Refuse a compute capability no GPU that runs this vLLM has; the
    backend rules alone accept any number (FlashAttention: >= 8.0)."""
    major, minor = parse_device_capability(value)
    archs = _torch_cuda_archs()
    if archs is None:
        return [
            f"`device_capability` {value}: this torch has no CUDA build to check "
            "it against; the backends are chosen for it as given."
        ]
    # SASS runs on GPUs of its major version and an equal or higher minor;
    # PTX (compute_XY) on any GPU from XY on.
    runs = any(
        (kind == "sm" and a == major and b <= minor)
        or (kind == "compute" and (a, b) <= (major, minor))
        for kind, a, b in archs
    )
    if not runs:
        import torch

        built = ", ".join(f"{k}_{a}{b}" for k, a, b in archs)
        raise CapacityInputError(
            f"no GPU of compute capability {major}.{minor} runs this vLLM: its "
            f"torch {torch.__version__} carries CUDA kernels for {built}, and a "
            "kernel runs only on GPUs of its major version with an equal or "
            "higher minor. Give the capability of the GPU you plan for, e.g. 8.9 "
            "(L4/RTX 40), 9.0 (H100/H200), 10.0 (B200) or 12.0 (RTX 50).",
            "device_capability",
            value,
        )
    return []


def series_modules() -> list[str]:
    """The hybridkv series' planning modules this vLLM carries."""
    return [m for m in SERIES_PLANNING_MODULES if importlib.util.find_spec(m)]


@functools.cache
def engine_module(name: str) -> types.ModuleType | None:
    """The engine module ``name`` where this vLLM has it; None on vLLM 0.20.2
    or at a place in the hybridkv series before the patch that adds it, where
    the engine applies 0.20.2's rule and so does the planner."""
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def _engine_default(name: str) -> Any:
    """The default of an ``EngineArgs`` field (what `vllm serve` takes)."""
    from vllm.engine.arg_utils import EngineArgs

    return next(f.default for f in dataclasses.fields(EngineArgs) if f.name == name)


def check_request(req: CapacityRequest) -> list[str]:
    """Refuse, by field, inputs that cannot describe a run of the engine.
    Returns warnings: inputs taken that change nothing in the plan."""
    use_planning_platform()
    warnings: list[str] = []
    _model_dir("model", req.model)
    if req.draft is not None:
        _model_dir("draft", req.draft)
    if req.pristine:
        found = series_modules()
        if found:
            import vllm

            raise CapacityInputError(
                f"this vLLM ({vllm.__version__}) carries the hybridkv series "
                f"({', '.join(found)}), whose engine code plans with the series' "
                "rules; planning 0.20.2's rules with it would mix both (e.g. plan "
                "TurboQuant on a hybrid that vLLM 0.20.2 refuses). Run the planner "
                "against an unpatched vllm==0.20.2 install, where it plans with "
                "0.20.2's rules, or leave `pristine` out.",
                "pristine",
                req.pristine,
            )
    _positive("max_model_len", req.max_model_len, "Give the context length to plan.")
    _positive(
        "tensor_parallel_size",
        req.tensor_parallel_size,
        "It is the number of GPUs the model is sharded over (1 for one GPU).",
    )
    if req.num_speculative_tokens < 0:
        raise CapacityInputError(
            "must be 0 (no speculative decoding) or more.",
            "num_speculative_tokens",
            req.num_speculative_tokens,
        )
    if req.draft is not None and req.num_speculative_tokens == 0:
        raise CapacityInputError(
            "needs `num_speculative_tokens` N (N >= 1), the tokens the draft model "
            "proposes per step.",
            "draft",
            req.draft,
        )
    _positive("block_size", req.block_size, "Leave it out to plan the default.")
    _positive(
        "max_num_batched_tokens",
        req.max_num_batched_tokens,
        "It is the tokens the engine schedules per step; leave it out for the "
        "engine's default.",
    )
    if req.usage_context not in USAGE_CONTEXTS:
        raise CapacityInputError(
            f"expected one of {', '.join(USAGE_CONTEXTS)} (`vllm serve` or the "
            "Python LLM class).",
            "usage_context",
            req.usage_context,
        )
    from typing import get_args

    from vllm.config.cache import MambaDType

    for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        dtype = getattr(req, name)
        if dtype not in get_args(MambaDType):
            raise CapacityInputError(
                f"vLLM accepts {', '.join(repr(d) for d in get_args(MambaDType))} "
                "(as for `vllm serve`).",
                name,
                dtype,
            )
    from vllm.config.cache import MambaCacheMode

    modes = get_args(MambaCacheMode)
    if req.mamba_cache_mode is not None and req.mamba_cache_mode not in modes:
        raise CapacityInputError(
            f"not a Mamba cache mode: vLLM accepts {', '.join(map(repr, modes))} "
            "(as for `vllm serve`). Give one of them with `enable_prefix_caching`, "
            "or leave it out for vLLM's choice.",
            "mamba_cache_mode",
            req.mamba_cache_mode,
        )
    warnings += check_device_capability(req.device_capability)
    _positive("gpu_memory_gib", req.gpu_memory_gib, "It is one GPU's memory in GiB.")
    if req.gpu_memory_gib is not None and not math.isfinite(req.gpu_memory_gib * GIB):
        raise CapacityInputError(
            "too large to count in bytes. It is one GPU's memory in GiB, e.g. 80.",
            "gpu_memory_gib",
            req.gpu_memory_gib,
        )
    if req.kv_cache_memory_bytes is not None:
        _positive(
            "kv_cache_memory_bytes",
            req.kv_cache_memory_bytes,
            "It is the KV-cache memory per GPU, as the engine's kv_cache_memory_bytes.",
        )
        for name in ("weights_gib", "gpu_memory_utilization", "overhead_gib"):
            given = getattr(req, name)
            if given is not None:
                warnings.append(
                    f"`{name}` {given}: no effect, `kv_cache_memory_bytes` gives "
                    "the KV-cache memory (only `gpu_memory_gib` still counts: it "
                    "picks the engine's scheduler defaults)."
                )
        return warnings
    if req.gpu_memory_gib is None or req.weights_gib is None:
        raise CapacityInputError(
            "no memory to plan with: give `kv_cache_memory_bytes` (the KV-cache "
            "memory per GPU), or `gpu_memory_gib` (one GPU's memory) and "
            "`weights_gib` (the whole model's weights; divided by the "
            "tensor-parallel size)."
        )
    _positive("weights_gib", req.weights_gib, "It is the whole model's weights in GiB.")
    utilization = req.gpu_memory_utilization
    if utilization is not None and not math.isfinite(utilization):
        raise CapacityInputError(
            "must be a finite number in (0, 1], the share of each GPU's memory "
            "vLLM may use (e.g. 0.9).",
            "gpu_memory_utilization",
            utilization,
        )
    if utilization is not None and not 0 < utilization <= 1:
        raise CapacityInputError(
            "must be in (0, 1], the share of each GPU's memory vLLM may use "
            "(e.g. 0.9).",
            "gpu_memory_utilization",
            utilization,
        )
    overhead = req.overhead_gib
    if overhead is not None and not math.isfinite(overhead):
        raise CapacityInputError(
            "must be a finite number, 0 or more (activations, CUDA graphs and "
            "NCCL buffers per GPU).",
            "overhead_gib",
            overhead,
        )
    if overhead is not None and overhead < 0:
        raise CapacityInputError(
            "must be 0 or more (activations, CUDA graphs and NCCL buffers per GPU).",
            "overhead_gib",
            overhead,
        )
    return warnings


def available_kv_memory(req: CapacityRequest) -> int:
    if req.kv_cache_memory_bytes is not None:
        return req.kv_cache_memory_bytes
    assert req.gpu_memory_gib is not None and req.weights_gib is not None
    utilization = req.gpu_memory_utilization
    if utilization is None:
        utilization = _engine_default("gpu_memory_utilization")
    overhead = DEFAULT_OVERHEAD_GIB if req.overhead_gib is None else req.overhead_gib
    usable = req.gpu_memory_gib * utilization
    weights = req.weights_gib / req.tensor_parallel_size
    per_gpu = usable - weights - overhead
    if per_gpu <= 0:
        raise CapacityInputError(
            f"nothing left for the KV cache: {req.gpu_memory_gib} GiB x "
            f"{utilization} = {usable:.2f} GiB per GPU, minus weights "
            f"{weights:.2f} GiB (`weights_gib` / `tensor_parallel_size`) and "
            f"`overhead_gib` {overhead} leaves {per_gpu:.2f} GiB. Use more "
            "or larger GPUs, a higher `gpu_memory_utilization`, or smaller weights."
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
    """Layer ``i``'s config as the engine reads it: the text config, or its
    per-layer view where transformers >= 5.15 keeps attention shapes per layer
    (Gemma 4), read by ``per_layer_config`` (hybridkv 0010)."""
    per_layer = engine_module(PER_LAYER_CONFIG)
    if per_layer is None:
        return text_config
    return per_layer.layer_config(text_config, i)


def _values(text_config: Any, attr: str) -> list[Any]:
    """``attr`` of ``text_config``: every layer's value where it is per-layer."""
    per_layer = engine_module(PER_LAYER_CONFIG)
    if per_layer is None or attr not in (
        getattr(text_config, "per_layer_attributes", None) or ()
    ):
        return [getattr(text_config, attr, None)]
    layers = range(len(text_config.per_layer_config))
    values = {getattr(_layer_config(text_config, i), attr) for i in layers}
    return sorted(values, reverse=True)


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


def check_tensor_parallel(text_config: Any, tp: int, draft: str | None = None) -> None:
    """``text_config`` is the main model's, or that of the ``draft`` model
    directory, which runs at the main model's tensor-parallel size."""
    problems = tensor_parallel_problems(text_config, tp)
    if problems:
        fits = [n for n in range(1, 65) if not tensor_parallel_problems(text_config, n)]
        model = "the model" if draft is None else f"the draft model {draft}"
        raise CapacityInputError(
            f"{model} cannot be sharded over {tp} GPUs: "
            + "; ".join(problems)
            + ". The engine would stop at model load. Sizes that shard evenly: "
            + ", ".join(str(n) for n in fits[:8])
            + ".",
            "tensor_parallel_size",
            tp,
        )


def geometry_problems(text_config: Any) -> list[str]:
    """What makes the decoder of ``text_config`` one the engine cannot build."""
    problems = []
    if _values(text_config, "num_hidden_layers") == [None]:
        problems.append("num_hidden_layers (decoder layers) is missing")
    problems += _all_count_problems(lambda attr: _values(text_config, attr))
    if problems:
        return problems
    for q in _values(text_config, "num_attention_heads"):
        if q is None:
            continue
        for attr, what in _KV_HEADS:
            for kv in _values(text_config, attr):
                if kv is None:
                    continue
                if kv > q:
                    problems.append(
                        f"{attr}={kv} ({what}) is more than num_attention_heads={q} "
                        "(query heads)"
                    )
                elif q % kv:
                    problems.append(
                        f"num_attention_heads={q} (query heads) is not a multiple of "
                        f"{attr}={kv} ({what})"
                    )
        if _values(text_config, "head_dim") == [None]:
            hidden = getattr(text_config, "hidden_size", None)
            if _is_count(hidden) and hidden // q < 1:
                problems.append(
                    f"hidden_size={hidden} / num_attention_heads={q} leaves a head "
                    "size of 0 (no head_dim given)"
                )
    # Gated DeltaNet groups its value heads over its key heads.
    keys = getattr(text_config, "linear_num_key_heads", None)
    values = getattr(text_config, "linear_num_value_heads", None)
    if _is_count(keys) and _is_count(values) and values % keys:
        problems.append(
            f"linear_num_value_heads={values} (linear-attention value heads) is not "
            f"a multiple of linear_num_key_heads={keys} (its key heads)"
        )
    n = getattr(text_config, "num_hidden_layers", None)
    for attr in ("layer_types", "layers_block_type"):
        kinds = getattr(text_config, attr, None)
        if isinstance(kinds, (list, tuple)) and kinds and len(kinds) < n:
            problems.append(
                f"{attr} has {len(kinds)} entries for num_hidden_layers={n} layers"
            )
        if isinstance(kinds, (list, tuple)) and "sliding_attention" in kinds:
            window = getattr(text_config, "sliding_window", None)
            if not (_is_count(window) and window >= 1):
                problems.append(
                    f"sliding_window={window!r} (tokens a sliding-window layer "
                    "attends to) must be a whole number of at least 1"
                )
    return problems


def check_geometry(text_config: Any, field: str, value: str) -> None:
    problems = geometry_problems(text_config)
    if problems:
        raise _geometry_error(field, value, problems)


def check_skip_layers(req: CapacityRequest, num_layers: int) -> None:
    for entry in req.kv_cache_dtype_skip_layers:
        if entry.isdigit() and int(entry) >= num_layers:
            raise CapacityInputError(
                f"the model has {num_layers} layers (indices 0-{num_layers - 1}), "
                "so this entry would skip nothing. Give an index in range, "
                "'boundary:N', 'draft' or 'sliding_window'.",
                "kv_cache_dtype_skip_layers",
                entry,
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
    infer device type"); ``plan_capacity`` calls this first, so the Python
    API plans wherever the command line does.
    """
    import vllm.platforms as platforms

    current = platforms._current_platform
    if current is not None and not current.is_unspecified():
        return
    if current is None:
        qualname = platforms.resolve_current_platform_cls_qualname()
        if qualname.endswith(".CudaPlatform"):
            return
    platforms._current_platform = _planning_platform_cls()()


@contextlib.contextmanager
def _cuda_target_config_check() -> Iterator[None]:
    # A CPU platform resolved before the planner ran (vLLM's CPU build, or a
    # platform plugin) must not apply CPU rules to a config planned for CUDA:
    # leave its config check out for this call only.
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


# What vllm/platforms/cuda.py imports for a CUDA run: the kernels, which load
# only where the NVIDIA driver (libcuda) is. Its platform rules do not use them.
_CUDA_KERNELS = ("vllm._C", "vllm._C_stable_libtorch")


def _import_without_cuda_kernels(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and not fromlist and name in _CUDA_KERNELS:
        return builtins.__import__("vllm")
    return builtins.__import__(name, globals, locals, fromlist, level)


@functools.cache
def _cuda_platform_module() -> types.ModuleType:
    """``vllm.platforms.cuda``, whose rules (attention backend selection,
    device queries) the planner asks for the target GPU.

    On a host without the NVIDIA driver the module does not import: it loads
    the CUDA kernels first. There its code is run once more, into a module of
    the planner's own, with the kernel imports skipped (its ``__import__``);
    nothing is registered in ``sys.modules``, so for the rest of the process
    vLLM's CUDA platform stays as unimportable on this host as it is.
    """
    try:
        return importlib.import_module("vllm.platforms.cuda")
    except ImportError:
        pass
    spec = importlib.util.find_spec("vllm.platforms.cuda")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__builtins__"] = {
        **vars(builtins),
        "__import__": _import_without_cuda_kernels,
    }
    spec.loader.exec_module(module)
    return module


def _cuda_platform_cls(
    capability: tuple[int, int], memory_bytes: int | None = None
) -> type:
    """vLLM's CUDA platform, answering for ``capability`` (and a GPU of
    ``memory_bytes``) instead of a device."""
    from vllm.platforms.interface import DeviceCapability

    CudaPlatform = _cuda_platform_module().CudaPlatform

    class CudaTarget(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            if memory_bytes is None:
                # The engine's fallback for a GPU it cannot query.
                raise RuntimeError("GPU memory not given (`gpu_memory_gib`)")
            return memory_bytes

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            # vLLM's defaults single out A100s by name (PR #17885); SM 8.0
            # GPUs of >= 70 GiB are A100s (and the A800, which it does not).
            if capability == (8, 0):
                return "NVIDIA A100"
            return f"NVIDIA GPU SM {capability[0]}.{capability[1]}"

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
        elif layer is not text or getattr(text, "global_head_dim", None):
            # Gemma 4: full-attention layers have their own heads and head_dim,
            # global_* in the text config, or the layer's own in a per-layer one.
            heads = (
                getattr(layer, "num_global_key_value_heads", None)
                or layer.num_key_value_heads
            )
            head_dim = getattr(layer, "global_head_dim", None) or layer.head_dim
            layers.append(LayerGeometry(attn, "full", per_rank(heads), head_dim))
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


def raw_window_twins(
    vllm_config: Any, layers: list[LayerGeometry]
) -> list[LayerGeometry]:
    """The model-dtype sliding-window twins ``recent:W`` gives the main
    model's TurboQuant layers (``turboquant.raw_window``), named as the
    engine names them."""
    raw_window = engine_module(RAW_WINDOW)
    if raw_window is None:
        return []
    policy = engine_module(LAYER_POLICY)
    window = policy.recent_window(vllm_config.cache_config.kv_cache_dtype_skip_layers)
    if not window:
        return []
    main_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    raw_window.check_config(vllm_config, window)
    return [
        LayerGeometry(
            raw_window.twin_name(g.name),
            "sliding",
            g.num_kv_heads,
            g.head_size,
            raw_window.twin_window(vllm_config, window),
        )  # fmt: skip
        for g in layers
        if g.kind == "full"
        and not policy.is_draft_layer(g.name, main_layers)
        and layer_kv_dtype(vllm_config, g, pristine=False).startswith("turboquant_")
    ]


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
    dtype, _ = engine_module(LAYER_POLICY).layer_kv_cache_dtype(
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
    model of ``kv_cache_page_unify``. vLLM 0.20.2 pads only Mamba pages, to
    ``page_size_padded``."""
    unify = engine_module(PAGE_UNIFY)
    if unify is not None:
        return unify.unpadded_page_size_bytes(spec)
    if getattr(spec, "page_size_padded", None) is None:
        return spec.page_size_bytes
    return replace(spec, page_size_padded=None).page_size_bytes


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
    from vllm.config import set_current_vllm_config
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
    with _flash_attn_on(cuda()):
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
                # As at model build: backends read the config being built (e.g.
                # FlashAttention's kernel block sizes for a given block size).
                with set_current_vllm_config(vllm_config):
                    path = cuda.get_attn_backend_cls(
                        vllm_config.attention_config.backend, selector
                    )
            except ValueError as e:
                failed[kind] = str(e)
                continue
            backend = importlib.import_module(path.rpartition(".")[0])
            chosen[kind] = getattr(backend, path.rpartition(".")[2]).get_name()
    return chosen, failed


@contextlib.contextmanager
def _flash_attn_on(target: Any) -> Iterator[None]:
    """FlashAttention answering for ``target`` while backends are chosen.

    Its checks (which FA version runs, whether it reads an FP8 cache:
    ``fa_utils``, ``vllm_flash_attn``) ask the process's ``current_platform``
    about the device, and FA3's library loads only where the NVIDIA driver
    is. On a host without a GPU both say no, and FP8 layers were planned on
    TRITON_ATTN where an SM 9.0 GPU runs FA3. Here they ask ``target``, and
    FA3 is available where this install ships its library. The backends are
    imported first, as on the CPU platform they were: their module-level
    imports follow the platform they were imported on.
    """
    import vllm.platforms as platforms
    from vllm.v1.attention.backends import fa_utils
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for backend in AttentionBackendEnum:
        with contextlib.suppress(Exception):
            backend.get_class()
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except ImportError:
        fa = None
    saved = platforms._current_platform, fa_utils.current_platform
    saved_fa3 = fa.FA3_AVAILABLE if fa is not None else None
    platforms._current_platform = fa_utils.current_platform = target
    if fa is not None:
        fa.FA3_AVAILABLE = saved_fa3 or bool(
            importlib.util.find_spec("vllm.vllm_flash_attn._vllm_fa3_C")
        )
    try:
        yield
    finally:
        platforms._current_platform, fa_utils.current_platform = saved
        if fa is not None:
            fa.FA3_AVAILABLE = saved_fa3


# --- plan ---------------------------------------------------------------------


def _planning_engine_args_cls(target_platform: Any) -> type:
    """``EngineArgs`` whose scheduler defaults are those of the target GPU.

    ``EngineArgs.get_batch_defaults`` picks max_num_batched_tokens by the
    current platform's GPU memory and name (and the usage context); planning
    runs on the CPU platform, whose defaults are the CPU backend's. The rule
    itself is the engine's: it is only asked about the target GPU.
    """
    from vllm.engine import arg_utils

    class PlanningEngineArgs(arg_utils.EngineArgs):
        @classmethod
        def get_batch_defaults(cls, world_size: int):
            saved = arg_utils.current_platform
            arg_utils.current_platform = target_platform
            try:
                return super().get_batch_defaults(world_size)
            finally:
                arg_utils.current_platform = saved

    return PlanningEngineArgs


def engine_config(
    req: CapacityRequest, capability: tuple[int, int] | None = None
) -> Any:
    from vllm.usage.usage_lib import UsageContext

    if capability is None:
        capability = parse_device_capability(req.device_capability)

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
    memory = None if req.gpu_memory_gib is None else int(req.gpu_memory_gib * GIB)
    target = _cuda_platform_cls(capability, memory)()
    engine_args = _planning_engine_args_cls(target)(
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
        max_num_batched_tokens=req.max_num_batched_tokens,
        mamba_cache_dtype=req.mamba_cache_dtype,
        mamba_ssm_cache_dtype=req.mamba_ssm_cache_dtype,
        enable_prefix_caching=req.enable_prefix_caching,
        mamba_cache_mode=(
            _engine_default("mamba_cache_mode")
            if req.mamba_cache_mode is None
            else req.mamba_cache_mode
        ),
    )
    with _cuda_target_config_check():
        return engine_args.create_engine_config(
            usage_context=UsageContext[USAGE_CONTEXTS[req.usage_context]]
        )


def _batch_source(req: CapacityRequest) -> str:
    if req.max_num_batched_tokens is not None:
        return "`max_num_batched_tokens`"
    who = "vllm serve" if req.usage_context == "serve" else "the LLM class"
    if req.gpu_memory_gib is None:
        return f"{who}'s default where the GPU's memory is not given (`gpu_memory_gib`)"
    return (
        f"{who}'s default for a {req.gpu_memory_gib:g} GiB GPU of SM "
        f"{req.device_capability}"
    )


def pad_to_max_fraction(specs: dict[str, Any]) -> float:
    largest = max(s.page_size_bytes for s in specs.values())
    real = sum(unpadded_page_size_bytes(s) for s in specs.values())
    return 1 - real / (largest * len(specs))


def check_model(req: CapacityRequest) -> None:
    """Checks the engine makes only later (at model load), or never."""
    from vllm.transformers_utils.config import get_config

    models = [("model", req.model)]
    if req.draft:
        models.append(("draft", req.draft))
    for field_name, model in models:
        try:
            hf_config = get_config(model, trust_remote_code=False)
        except Exception as e:
            # Parsing the user's config.json: whatever transformers (or
            # vLLM's config classes) raise here is about that file.
            cause = " ".join(f"{type(e).__name__}: {e}".split())
            raise CapacityInputError(
                f"transformers cannot read its config.json ({cause}). Fix the "
                "value it names in config.json (the engine reads it the same "
                "way), or fetch the model's config.json again.",
                field_name,
                model,
            ) from e
        text = hf_config.get_text_config()
        check_geometry(text, field_name, model)
        draft = model if field_name == "draft" else None
        check_tensor_parallel(text, req.tensor_parallel_size, draft)
        if draft is None:
            check_skip_layers(req, int(getattr(text, "num_hidden_layers", 0) or 0))


def _layer_index(name: str) -> int:
    return int(next(p for p in name.split(".") if p.isdigit()))


def _indices(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:12]))
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > 12 else "")


def _skip_rule_layers(
    vllm_config: Any, layers: list[LayerGeometry]
) -> tuple[list[int], list[LayerGeometry]]:
    """(the main model's attention layer indices, the drafter's layers) as the
    engine's skip rules count them (``layer_policy``). vLLM 0.20.2 has no
    drafter rule and matches an index against the layer of that index."""
    policy = engine_module(LAYER_POLICY)
    if policy is None:
        main = [g for g in layers if g.name.startswith("model.layers.")]
        attention = [_layer_index(g.name) for g in main if g.kind != "mamba"]
        drafters = [g for g in layers if not g.name.startswith("model.layers.")]
        return sorted(attention), drafters
    text_config = vllm_config.model_config.hf_text_config
    num_main = text_config.num_hidden_layers
    drafters = [g for g in layers if policy.is_draft_layer(g.name, num_main)]
    return policy.attention_layer_indices(text_config), drafters


def check_options_take_effect(
    req: CapacityRequest, vllm_config: Any, layers: list[LayerGeometry]
) -> list[str]:
    """Refuse options the engine takes and that would change nothing in this
    plan; return warnings for those that are merely redundant."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    attention, drafters = _skip_rule_layers(vllm_config, layers)
    entries = req.kv_cache_dtype_skip_layers
    skip = "kv_cache_dtype_skip_layers"
    if entries and cache_dtype == "auto":
        raise CapacityInputError(
            f"the KV cache is not quantized (`kv_cache_dtype` {req.kv_cache_dtype}), "
            "so every layer already stores the model dtype and the entries have no "
            "effect. Leave the option out, or give a quantized `kv_cache_dtype` "
            "(fp8, turboquant_4bit_nc, ...).",
            skip,
            entries,
        )
    for entry in entries:
        if entry.isdigit() and int(entry) not in attention:
            raise CapacityInputError(
                f"layer {entry} is a linear-attention (GDN/Mamba) layer; it keeps a "
                "recurrent state, not a KV cache, so the entry would skip nothing. "
                f"The model's attention layers are {_indices(attention)}: give one "
                "of those, 'boundary:N', 'draft' or 'sliding_window'.",
                skip,
                entry,
            )
        if entry == "sliding_window" and not any(g.kind == "sliding" for g in layers):
            raise CapacityInputError(
                "the model has no sliding-window layers, so the entry would skip "
                "nothing. Leave it out.",
                skip,
                entry,
            )
        if entry == "draft" and not drafters:
            raise CapacityInputError(
                "there is no drafter (`num_speculative_tokens` with the model's MTP "
                "layers, or `draft`), so the entry would skip nothing. Leave it "
                "out, or plan the speculative decoding it is meant for.",
                skip,
                entry,
            )
        if entry.startswith("boundary:") and entry[len("boundary:") :].isdigit():
            n = int(entry[len("boundary:") :])
            if not cache_dtype.startswith("turboquant_"):
                raise CapacityInputError(
                    "boundary protection is TurboQuant's; with `kv_cache_dtype` "
                    f"{cache_dtype} the engine matches layers by index only, so the "
                    "entry would skip nothing. Give the indices of the layers to "
                    "keep instead.",
                    skip,
                    entry,
                )
            if n > len(attention):
                raise CapacityInputError(
                    f"the model has {len(attention)} attention layers "
                    f"({_indices(attention)}), so boundary:{n} would keep every one "
                    f"at the model dtype and `kv_cache_dtype` {cache_dtype} would "
                    "apply to none. Give N of at most "
                    f"{max(0, (len(attention) - 1) // 2)} (N at each end), or "
                    "`kv_cache_dtype` auto.",
                    skip,
                    entry,
                )
    if not any(g.kind == "mamba" for g in layers):
        for name, default in (
            ("mamba_cache_dtype", "auto"),
            ("mamba_ssm_cache_dtype", "auto"),
            ("mamba_cache_mode", None),
        ):
            given = getattr(req, name)
            if given != default:
                raise CapacityInputError(
                    "the model has no GDN/Mamba layers, so it has no effect. "
                    "Leave it out.",
                    name,
                    given,
                )
    warnings = check_mamba_cache_mode(req, vllm_config)
    if req.language_model_only and not vllm_config.model_config.is_multimodal_model:
        warnings.append(
            "`language_model_only`: no effect, the model has no multimodal encoder."
        )
    return warnings


def check_mamba_cache_mode(req: CapacityRequest, vllm_config: Any) -> list[str]:
    """A Mamba cache mode the engine replaces by another (its config checks,
    ``HybridAttentionMambaModelConfig``): refused where that makes it change
    nothing, a warning where vLLM falls back to a mode the model supports."""
    mode = req.mamba_cache_mode
    if mode is None:
        return []
    cache_config = vllm_config.cache_config
    final = cache_config.mamba_cache_mode
    if not cache_config.enable_prefix_caching:
        why = (
            "the engine's default for GDN/Mamba hybrids"
            if req.enable_prefix_caching is None
            else "as asked"
        )
        raise CapacityInputError(
            "a Mamba cache mode applies only with prefix caching, which is off "
            f'({why}); without it the engine sets the mode to none ("Mamba '
            "cache mode is set to 'none' when prefix caching is disabled\"), so "
            "it has no effect. Turn prefix caching on with "
            "`enable_prefix_caching`, or leave the mode out.",
            "mamba_cache_mode",
            mode,
        )
    if mode == "none":
        raise CapacityInputError(
            "with prefix caching on, the engine reads none as no choice and picks "
            f"its own mode ({final} for this model), so it has no effect. Give "
            "all or align, or leave it out for vLLM's choice.",
            "mamba_cache_mode",
            mode,
        )
    if final != mode:
        return [
            f"`mamba_cache_mode` {mode}: the engine falls back to {final}, as "
            f"{vllm_config.model_config.architecture} has no prefix caching in "
            f"Mamba cache mode {mode}; the plan is {final}'s."
        ]
    return []


def check_quantized_layers(
    req: CapacityRequest, vllm_config: Any, layer_dtypes: dict[str, int]
) -> None:
    """A quantized ``kv_cache_dtype`` that the skip rules keep off every layer."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    # A layer with its own TurboQuant preset is quantized too.
    if (
        cache_dtype == "auto"
        or not layer_dtypes
        or any(d != "auto" for d in layer_dtypes)
    ):
        return
    resolved = list(vllm_config.cache_config.kv_cache_dtype_skip_layers or [])
    indices = sum(1 for entry in resolved if entry.isdigit())
    given = " ".join(req.kv_cache_dtype_skip_layers) or "none given"
    raise CapacityInputError(
        "no attention layer is left at it: the skip rules "
        f"(`kv_cache_dtype_skip_layers`: {given}; the engine adds boundary "
        f"protection's and sliding-window layers, {indices} layer indices in all) "
        f"keep all {sum(layer_dtypes.values())} attention layers at the model "
        "dtype, so the option has no effect. Keep fewer layers (e.g. a smaller "
        "boundary:N, or boundary:0), or use `kv_cache_dtype` auto.",
        "kv_cache_dtype",
        req.kv_cache_dtype,
    )


def _spec_dtype(spec: Any) -> str:
    dtypes = getattr(spec, "dtypes", None)
    if dtypes is not None:  # MambaSpec: one dtype per state tensor
        return str(tuple(dtypes))
    return str(getattr(spec, "dtype", ""))


def layer_pages(spec: Any, layer_names: list[str]) -> list[dict[str, Any]]:
    """One row per kind of layer in a group, each describing one block of ONE
    layer. A ``UniformTypeKVCacheSpecs`` group's spec sums its layers' pages;
    its rows are its layers' own specs."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    rows: dict[tuple, dict[str, Any]] = {}
    for name in layer_names:
        one = (
            spec.kv_cache_specs[name]
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else spec
        )
        page = one.page_size_bytes
        padding = page - unpadded_page_size_bytes(one)
        key = (type(one).__name__, one.block_size, page, padding, _spec_dtype(one))
        row = rows.setdefault(
            key,
            {
                "type": key[0],
                "layers": 0,
                "first_layer": name,
                "block_size": one.block_size,
                "page_size_bytes": page,
                "padding_bytes": padding,
                "dtype": key[4],
            },
        )
        row["layers"] += 1
    return list(rows.values())


def describe_groups(vllm_config: Any, config: Any, report: CapacityReport) -> None:
    """Groups, per-layer pages and padding of the engine's KV-cache config.

    Padding is counted as the engine counts it: a block id spans every
    KV-cache tensor (``config.kv_cache_tensors``) with a page for it, so a
    block of a group with fewer layers than the others leaves page slots empty
    (upstream's "Add N padding layers" warning, repeated here with its figure),
    and the share of KV memory is taken with every group holding the same
    number of blocks (``PagePadding.fraction`` of kv_cache_page_unify, whose
    log line this equals where no slot is empty), and again with each group
    weighted by the blocks a ``max_model_len`` request holds in it.
    """
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = config.kv_cache_groups
    num_blocks = max(1, config.num_blocks)
    page_sets = any(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups
    )
    # One page of each layer slot; a UniformTypeKVCacheSpecs layout's tensors
    # are its layers' own, of their own page sizes.
    page = max((t.size for t in config.kv_cache_tensors), default=0) // num_blocks
    tensor_pages = [t.size // page if page else 0 for t in config.kv_cache_tensors]
    if not page_sets:
        report.tensor_pages = {
            n: tensor_pages.count(n) for n in sorted(set(tensor_pages))
        }

    def block_bytes(group: Any) -> int:
        """A block of ``group``: a page in every full-length tensor, and in a
        shorter one only where one of its own layers shares it."""
        if page_sets:
            return sum(t.size for t in config.kv_cache_tensors) // num_blocks
        own = set(group.layer_names)
        return page * sum(
            n == config.num_blocks or bool(own.intersection(t.shared_by))
            for n, t in zip(tensor_pages, config.kv_cache_tensors)
        )

    slots = max(len(g.layer_names) for g in groups)
    wasted = spanned = 0
    full_wasted = full_spanned = 0
    by_spec: dict[Any, list[Any]] = {}
    for group in groups:
        spec = group.kv_cache_spec
        rows = layer_pages(spec, group.layer_names)
        one = {r["page_size_bytes"] for r in rows}
        padding = {r["padding_bytes"] for r in rows}
        held = sum(
            r["layers"] * (r["page_size_bytes"] - r["padding_bytes"]) for r in rows
        )
        uniform_type = isinstance(spec, UniformTypeKVCacheSpecs)
        held_blocks = cdiv(
            spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes
        )
        block = block_bytes(group)
        report.groups.append(
            {
                "type": type(spec).__name__,
                "layers": len(group.layer_names),
                "padding_layers": 0 if uniform_type else slots - len(group.layer_names),
                "first_layer": group.layer_names[0],
                "block_size": spec.block_size,
                "page_size_bytes": one.pop() if len(one) == 1 else None,
                "padding_bytes": padding.pop() if len(padding) == 1 else None,
                "dtype": rows[0]["dtype"] if len(rows) == 1 else None,
                "layer_pages": rows,
                "blocks_per_request": held_blocks,
            }
        )
        wasted += block - held
        spanned += block
        full_wasted += held_blocks * (block - held)
        full_spanned += held_blocks * block
        if not uniform_type:
            by_spec.setdefault(spec, []).append(group)
    report.padding_bytes_per_page_set = wasted
    report.padding_fraction = wasted / spanned if spanned else 0.0
    report.padding_fraction_full_load = (
        full_wasted / full_spanned if full_spanned else 0.0
    )
    for spec, same in by_spec.items():
        layers = sum(len(g.layer_names) for g in same)
        empty = len(same) * slots - layers
        if empty:
            report.padding_layers += empty
            # The engine's warning (_get_kv_cache_groups_uniform_page_size).
            report.padding_warnings.append(
                f"{type(spec).__name__} ({layers} layers from "
                f"{same[0].layer_names[0]}): Add {empty} padding layers, may waste "
                f"at most {empty / layers * 100:.2f}% KV cache memory"
            )
    pages = {r["page_size_bytes"] for g in report.groups for r in g["layer_pages"]}
    report.page_size_bytes = pages.pop() if len(pages) == 1 else None


def plan_capacity(req: CapacityRequest) -> CapacityReport:
    """Plan ``req`` the way the engine would at start-up, on this host."""
    use_planning_platform()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings = check_request(req)
    import vllm
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    memory = available_kv_memory(req)
    capability = parse_device_capability(req.device_capability)
    # Without the series' planning modules this is an unpatched vLLM: its
    # rules (check_request refuses pristine=True on a patched one).
    pristine = req.pristine or engine_module(LAYER_POLICY) is None
    report = CapacityReport(
        model=req.model,
        kv_cache_dtype=req.kv_cache_dtype,
        tensor_parallel_size=req.tensor_parallel_size,
        max_model_len=req.max_model_len,
        kv_cache_memory_bytes=memory,
        vllm=vllm.__version__,
        device_capability=f"{capability[0]}.{capability[1]}",
        usage_context=req.usage_context,
        max_num_batched_tokens_source=_batch_source(req),
        warnings=warnings,
    )
    check_model(req)
    try:
        with _engine_step("engine configuration"):
            vllm_config = engine_config(req, capability)
        report.max_num_batched_tokens = (
            vllm_config.scheduler_config.max_num_batched_tokens
        )
        cache_config = vllm_config.cache_config
        report.enable_prefix_caching = cache_config.enable_prefix_caching
        report.prefix_caching_source = (
            "the engine's default for this model"
            if req.enable_prefix_caching is None
            else "as asked"
        )
        report.mamba_cache_mode = cache_config.mamba_cache_mode
        layers = all_layers(vllm_config)
        if not pristine:
            with _engine_step("the raw windows' twin layers"):
                layers += raw_window_twins(vllm_config, layers)
        report.warnings += check_options_take_effect(req, vllm_config, layers)
        with _engine_step("block size for the hybrid page layout"):
            plan_block_size(vllm_config, layers, pristine)
        with _engine_step("KV-cache specs"):
            specs, report.layer_dtypes = kv_cache_specs(vllm_config, layers, pristine)
        check_quantized_layers(req, vllm_config, report.layer_dtypes)
        with _engine_step("KV-cache groups and pages"):
            config = get_kv_cache_configs(vllm_config, [specs], [memory])[0]
    except EngineRefusal as e:
        report.error = str(e)
        return report
    finally:
        for warning in report.warnings:
            logger.warning("%s", warning)
    report.attention_backends, report.backend_errors = attention_backends(
        vllm_config, layers, capability, pristine
    )
    report.block_size = vllm_config.cache_config.block_size
    # The hybrid page planner sets it with the block size.
    report.mamba_block_size = vllm_config.cache_config.mamba_block_size
    report.num_blocks = config.num_blocks
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, config)
    report.max_concurrency = round(concurrency, 2)
    report.kv_tokens = int(concurrency * vllm_config.model_config.max_model_len)
    describe_groups(vllm_config, config, report)
    if not any(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        for g in config.kv_cache_groups
    ):
        report.pad_to_max_fraction = pad_to_max_fraction(specs)
    return report


def format_report(r: CapacityReport) -> str:
    head = (
        f"{r.model}  kv_cache_dtype={r.kv_cache_dtype}  TP={r.tensor_parallel_size}  "
        f"max_model_len={r.max_model_len:,}  "
        f"KV memory/GPU={r.kv_cache_memory_bytes / GIB:.2f} GiB  (vLLM {r.vllm})"
    )
    notes = [f"  warning: {w}" for w in r.warnings]
    if r.error:
        cause = "\n".join("    " + line for line in r.error.splitlines())
        return "\n".join([head, *notes, f"  FAILS at engine start-up, in\n{cause}"])
    lines = [head, *notes, f"  layer KV dtypes: {r.layer_dtypes}"]
    if r.max_num_batched_tokens is not None:
        lines.append(
            f"  max_num_batched_tokens: {r.max_num_batched_tokens:,} "
            f"({r.max_num_batched_tokens_source})"
        )
    if r.enable_prefix_caching is not None:
        caching = (
            f"  prefix caching: {'on' if r.enable_prefix_caching else 'off'} "
            f"({r.prefix_caching_source})"
        )
        if r.mamba_block_size is not None:
            caching += (
                f"; Mamba cache mode: {r.mamba_cache_mode}, "
                f"mamba_block_size: {r.mamba_block_size:,}"
            )
        lines.append(caching)
    # Every page figure is one block of ONE layer, whatever the spec type.
    lines.append(
        f"  {'KV cache groups':<24}{'groups':>7}{'layers':>7}{'block':>7}"
        f"{'page B/layer':>14}{'pad B/layer':>13}  first layer"
    )
    rows: dict[tuple, list] = {}
    uniform_type = False
    for index, g in enumerate(r.groups):
        inside = g["type"] == "UniformTypeKVCacheSpecs"
        uniform_type |= inside
        for p in g["layer_pages"]:
            kind = f"{p['type']}*" if inside else p["type"]
            key = (kind, p["block_size"], p["page_size_bytes"], p["padding_bytes"])
            rows.setdefault((*key, p["dtype"]), []).append((index, p))
    for (kind, block, page, pad, _), members in rows.items():
        layers = sum(p["layers"] for _, p in members)
        groups = len({index for index, _ in members})
        lines.append(
            f"  {kind:<24}{groups:>7}{layers:>7}{block:>7}{page:>14,}"
            f"{pad:>13,}  {members[0][1]['first_layer']}"
        )
    if uniform_type:
        lines.append(
            "  * layers of one UniformTypeKVCacheSpecs group (one block spans "
            "them all), by page size"
        )
    lines.append(
        f"  padding: {100 * r.padding_fraction:.2f}% of KV memory holds no data "
        f"({r.padding_bytes_per_page_set:,} B per block of every group); "
        f"{100 * r.padding_fraction_full_load:.2f}% with the cache full of "
        f"{r.max_model_len:,}-token requests"
    )
    if r.padding_layers:
        lines.append(f"    {r.padding_layers} padding layers; the engine warns:")
        lines += [f"      {w}" for w in r.padding_warnings]
    if r.pad_to_max_fraction is not None:
        lines.append(
            "    pages padded to the largest instead (upstream 0.33): "
            f"{100 * r.pad_to_max_fraction:.2f}% page padding"
        )
    if len(r.tensor_pages) > 1:
        lines.append(
            "  KV-cache tensors: "
            + ", ".join(
                f"{n} of {pages:,} pages" for pages, n in r.tensor_pages.items()
            )
            + f" (block ids below {min(r.tensor_pages):,} for the layers on the "
            "shorter)"
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
