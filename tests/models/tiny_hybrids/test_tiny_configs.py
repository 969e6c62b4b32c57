# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM (0.20.2 with the series) parses from the tiny builders and the
full-size records.

Three depths, so that a failure says how far vLLM got:

1. ``get_config``: vLLM's config loader (its own Qwen3.5/Qwen3-Next config
   classes, transformers' for Gemma 4 and Qwen3). Always runs.
2. vLLM's ``ModelArchConfig`` convertor (head size, KV heads, layer count,
   mm-prefix, MTP layer count): what ``ModelConfig`` derives, without the
   model-class import.
3. ``ModelConfig`` itself (architecture resolution, ``is_hybrid``, per-type
   layer counts, the MTP drafter's config). This imports the model class;
   vLLM's qwen3_5.py / qwen3_5_mtp.py / gemma4_mm.py import transformers'
   image processors, which need torchvision (the test env has it).

Gemma 4 with transformers >= 5.15: ``Gemma4TextConfig`` turns
``global_head_dim`` and ``num_global_key_value_heads`` into a heterogeneous
``per_layer_config`` and reading ``head_dim`` on the text config raises
``AmbiguousGlobalPerLayerAttributeError``; vLLM 0.20.2 fails on it, patch 0010
reads both layouts. CI runs this module under the test env's transformers
(5.14.1) and again under 5.17.0 and 5.23.0 (scripts/test-transformers.sh).
"""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.transformers_utils.config import get_config, get_hf_text_config
from vllm.transformers_utils.model_arch_config_convertor import (
    MODEL_ARCH_CONFIG_CONVERTORS,
    ModelArchConfigConvertorBase,
)

from . import builders, shapes
from .builders import layer_indices
from .tokenizer import EOS_ID, TINY_VOCAB_SIZE

pytestmark = pytest.mark.cpu_test


@dataclass(frozen=True)
class Expected:
    """What vLLM should parse; numbers are literals so the records are checked too."""

    architecture: str
    model_type: str
    is_hybrid: bool
    head_size: int  # ModelConfig.get_head_size(): max over layer kinds
    kv_heads: int  # ModelConfig.get_total_num_kv_heads()
    num_layers: int
    full_attention: list[int]
    mtp_layers: int | None = None  # None: no MTP module
    mtp_architecture: str | None = None
    sliding_window: int | None = None
    mm_prefix: bool = False
    # layer kind -> (head_dim, kv heads), for models whose kinds differ.
    per_kind: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def is_gemma4(self) -> bool:
        return self.model_type == "gemma4"


TINY = {
    "qwen3_5_text": Expected(
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        is_hybrid=True,
        head_size=256,
        kv_heads=2,
        num_layers=8,
        full_attention=[3, 7],
        mtp_layers=1,
        mtp_architecture="Qwen3_5MTP",
    ),
    "qwen3_next": Expected(
        architecture="Qwen3NextForCausalLM",
        model_type="qwen3_next",
        is_hybrid=True,
        head_size=256,
        kv_heads=2,
        num_layers=8,
        full_attention=[3, 7],
        mtp_layers=1,
        mtp_architecture="Qwen3NextMTP",
    ),
    "gemma4_mm": Expected(
        architecture="Gemma4ForConditionalGeneration",
        model_type="gemma4",
        is_hybrid=False,
        head_size=512,
        kv_heads=4,
        num_layers=12,
        full_attention=[5, 11],
        sliding_window=128,
        mm_prefix=True,
        per_kind={"sliding_attention": (256, 4), "full_attention": (512, 1)},
    ),
    "qwen3_dense": Expected(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        is_hybrid=False,
        head_size=128,
        kv_heads=2,
        num_layers=6,
        full_attention=[0, 1, 2, 3, 4, 5],
    ),
}

_QWEN3_4B = Expected(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    is_hybrid=False,
    head_size=128,
    kv_heads=8,
    num_layers=36,
    full_attention=list(range(36)),
)

FULL_SIZE = {
    "Qwen3.6-27B": Expected(
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        is_hybrid=True,
        head_size=256,
        kv_heads=4,
        num_layers=64,
        full_attention=list(range(3, 64, 4)),
        mtp_layers=1,
        mtp_architecture="Qwen3_5MTP",
    ),
    "Qwen3-Coder-Next-80B-A3B": Expected(
        architecture="Qwen3NextForCausalLM",
        model_type="qwen3_next",
        is_hybrid=True,
        head_size=256,
        kv_heads=2,
        num_layers=48,
        full_attention=list(range(3, 48, 4)),
        mtp_layers=1,
        mtp_architecture="Qwen3NextMTP",
    ),
    "LocoOperator-4B": _QWEN3_4B,
    "Gemma-4-31B": Expected(
        architecture="Gemma4ForConditionalGeneration",
        model_type="gemma4",
        is_hybrid=False,
        head_size=512,
        kv_heads=16,
        num_layers=60,
        full_attention=list(range(5, 60, 6)),
        sliding_window=1024,
        mm_prefix=True,
        per_kind={"sliding_attention": (256, 16), "full_attention": (512, 4)},
    ),
    "Qwen3-4B": _QWEN3_4B,
}


def test_expectations_cover_everything():
    assert set(TINY) == set(builders.BUILDERS)
    assert set(FULL_SIZE) == set(shapes.FULL_SIZE_MODELS)


# ---- cases and their marks -------------------------------------------------


def _cases(depth: str) -> list:
    """(kind, name) params for tests at ``depth`` in {"hf", "arch", "model"}."""
    params = []
    for kind, table in (("tiny", TINY), ("full", FULL_SIZE)):
        for name, exp in table.items():
            params.append(pytest.param(kind, name, id=f"{kind}-{name}"))
    return params


def _build(kind: str, name: str, tmp_path: Path) -> tuple[Path, Expected]:
    if kind == "tiny":
        return builders.BUILDERS[name](tmp_path / name), TINY[name]
    return shapes.write_full_size_config(name, tmp_path / "full"), FULL_SIZE[name]


def _layer_geometry(text_config, layer: int) -> tuple[int, int]:
    """(head_dim, kv heads) of ``layer``, from either Gemma 4 config shape."""
    if getattr(text_config, "is_heterogeneous", False):
        layer_config = text_config.per_layer_config[layer]
        return layer_config.head_dim, layer_config.num_key_value_heads
    if text_config.layer_types[layer] == "full_attention":
        kv = text_config.num_key_value_heads
        if text_config.attention_k_eq_v:
            kv = text_config.num_global_key_value_heads
        return text_config.global_head_dim, kv
    return text_config.head_dim, text_config.num_key_value_heads


def _mtp_layers_in_config(text_config) -> int | None:
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if hasattr(text_config, key):
            return getattr(text_config, key)
    return None


# ---- depth 1: vLLM's config loader ------------------------------------------


@pytest.mark.parametrize(("kind", "name"), _cases("hf"))
def test_hf_config(kind, name, tmp_path):
    path, exp = _build(kind, name, tmp_path)
    hf_config = get_config(str(path), trust_remote_code=False)
    text = get_hf_text_config(hf_config)

    assert hf_config.architectures == [exp.architecture]
    assert hf_config.model_type == exp.model_type
    assert text.num_hidden_layers == exp.num_layers
    assert layer_indices(text.layer_types, "full_attention") == exp.full_attention
    assert _mtp_layers_in_config(text) == exp.mtp_layers
    assert getattr(text, "sliding_window", None) == exp.sliding_window

    if exp.is_hybrid:
        # Every non-attention layer is Gated DeltaNet, with 128-dim heads.
        gdn = layer_indices(text.layer_types, "linear_attention")
        assert sorted(gdn + exp.full_attention) == list(range(exp.num_layers))
        assert text.linear_key_head_dim == text.linear_value_head_dim == 128
        assert text.linear_num_value_heads % text.linear_num_key_heads == 0
    for layer, kind_ in enumerate(text.layer_types):
        if kind_ in exp.per_kind:
            assert _layer_geometry(text, layer) == exp.per_kind[kind_], layer
    if exp.is_gemma4:
        assert text.use_bidirectional_attention == "vision"
        assert set(text.layer_types) == {"sliding_attention", "full_attention"}


# ---- depth 2: vLLM's arch-config convertor ----------------------------------


def _arch_config(hf_config):
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(
        hf_config.model_type, ModelArchConfigConvertorBase
    )
    return convertor(hf_config, get_hf_text_config(hf_config)).convert()


@pytest.mark.parametrize(("kind", "name"), _cases("arch"))
def test_arch_config(kind, name, tmp_path):
    path, exp = _build(kind, name, tmp_path)
    arch = _arch_config(get_config(str(path), trust_remote_code=False))

    assert arch.architectures == [exp.architecture]
    assert arch.head_size == exp.head_size
    assert arch.total_num_kv_heads == exp.kv_heads
    assert arch.total_num_hidden_layers == exp.num_layers
    assert arch.is_mm_prefix_lm == exp.mm_prefix

    if exp.mtp_layers is not None:
        # The MTP drafter's config is the target's, rewritten by this hook.
        mtp_config = SpeculativeConfig.hf_config_override(
            get_config(str(path), trust_remote_code=False)
        )
        mtp_arch = _arch_config(mtp_config)
        assert mtp_arch.architectures == [exp.mtp_architecture]
        assert mtp_arch.total_num_hidden_layers == exp.mtp_layers


# ---- depth 3: ModelConfig ------------------------------------------------------


@pytest.fixture
def inspect_in_process(monkeypatch):
    """Inspect model classes in this process instead of a fresh interpreter.

    vLLM does it in a subprocess to keep CUDA uninitialized in the engine's
    parent; on a cold model-info cache that costs ~15 s per architecture on a
    2-core box, against 1-5 s for the same ``_ModelInfo`` computed here.
    """
    from vllm.model_executor.models import registry

    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())


def _model_config(path: Path, **kwargs) -> ModelConfig:
    return ModelConfig(
        model=str(path), tokenizer=str(path), skip_tokenizer_init=True, **kwargs
    )


@pytest.mark.parametrize(("kind", "name"), _cases("model"))
def test_model_config(kind, name, tmp_path, inspect_in_process):
    path, exp = _build(kind, name, tmp_path)
    mc = _model_config(path)
    parallel = ParallelConfig()

    assert mc.architecture == exp.architecture
    assert mc.is_hybrid == exp.is_hybrid
    assert mc.get_head_size() == exp.head_size
    assert mc.get_total_num_kv_heads() == exp.kv_heads
    assert mc.get_total_num_hidden_layers() == exp.num_layers
    assert mc.get_sliding_window() == exp.sliding_window
    assert mc.is_mm_prefix_lm == exp.mm_prefix
    assert mc.dtype == torch.bfloat16
    assert (
        layer_indices(mc.hf_text_config.layer_types, "full_attention")
        == exp.full_attention
    )
    attention_layers = mc.get_num_layers_by_block_type(parallel, "attention")
    if exp.is_hybrid:
        assert attention_layers == len(exp.full_attention)
        assert mc.get_num_layers_by_block_type(parallel, "linear_attention") == (
            exp.num_layers - len(exp.full_attention)
        )
    else:
        assert attention_layers == exp.num_layers

    if exp.mtp_layers is not None:
        mtp = _model_config(path, hf_overrides=SpeculativeConfig.hf_config_override)
        assert mtp.architecture == exp.mtp_architecture
        assert mtp.get_total_num_hidden_layers() == exp.mtp_layers


# ---- TurboQuant boundary protection ------------------------------------------

# TurboQuant quantizes the attention layers outside get_boundary_skip_layers,
# which vLLM 0.20.2 computes over hf_text_config.num_hidden_layers
# (engine/arg_utils.py). Expected: (skip list, full-attention layers quantized).
TQ_TINY = {
    "qwen3_5_text": (["0", "1", "6", "7"], [3]),
    "qwen3_next": (["0", "1", "6", "7"], [3]),
    "gemma4_mm": (["0", "1", "10", "11"], [5]),
    "qwen3_dense": (["0", "1", "4", "5"], [2, 3]),
}


@pytest.mark.parametrize("name", list(TQ_TINY))
def test_turboquant_boundary_skip_leaves_attention_layers(name, tmp_path):
    path = builders.BUILDERS[name](tmp_path / name)
    text = get_hf_text_config(get_config(str(path), trust_remote_code=False))
    skip = TurboQuantConfig.get_boundary_skip_layers(text.num_hidden_layers)

    full = layer_indices(text.layer_types, "full_attention")
    quantized = [i for i in full if str(i) not in skip]
    assert (skip, quantized) == TQ_TINY[name]
    assert quantized, "defaults must leave a full-attention layer for TurboQuant"


def test_turboquant_boundary_skip_full_size_qwen3_6():
    # The analysis' example: [0, 1, 62, 63] for 64 layers, where 0/1/62 are GDN
    # (no-op) and 63 is the only protected full-attention layer.
    text = shapes.load_full_size("Qwen3.6-27B")["text_config"]
    skip = TurboQuantConfig.get_boundary_skip_layers(text["num_hidden_layers"])
    assert skip == ["0", "1", "62", "63"]
    assert [text["layer_types"][int(i)] for i in skip] == [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ]


# ---- builders: overrides, tokenizer, records ---------------------------------


def test_builder_keyword_overrides(tmp_path):
    path = builders.qwen3_5_text(
        tmp_path / "q", num_layers=12, mtp_layers=2, num_kv_heads=4
    )
    text = get_hf_text_config(get_config(str(path), trust_remote_code=False))
    assert text.num_hidden_layers == 12
    assert layer_indices(text.layer_types, "full_attention") == [3, 7, 11]
    assert text.mtp_num_hidden_layers == 2
    assert text.num_key_value_heads == 4

    path = builders.gemma4_mm(tmp_path / "g", num_layers=6, num_kv_heads=2)
    text = get_hf_text_config(get_config(str(path), trust_remote_code=False))
    assert layer_indices(text.layer_types, "full_attention") == [5]
    assert _layer_geometry(text, 0) == (256, 2)
    assert _layer_geometry(text, 5) == (512, 1)


def test_checkpoint_builds_after_vllm_parsed_a_config(tmp_path):
    """vLLM's config parser registers its own qwen3_5 config class with
    AutoConfig for the whole process, and the GPU suite builds checkpoints after
    engines ran in it. transformers 5.17 (the GPU image's) could not build the
    vision tower from vLLM's class: "'Qwen3_5VisionConfig' object has no
    attribute 'rope_parameters'". The test env's release (5.14.1) builds it
    from either class; scripts/test-transformers.sh runs this file under 5.17."""
    from . import checkpoints

    cfg = checkpoints.write_config("qwen3_5", tmp_path / "cfg")
    get_config(str(cfg), trust_remote_code=False)
    checkpoints.build_checkpoint("qwen3_5", tmp_path / "qwen3_5")


@pytest.mark.parametrize("name", list(builders.BUILDERS))
def test_tiny_tokenizer(name, tmp_path):
    from vllm.tokenizers import get_tokenizer

    path = builders.BUILDERS[name](tmp_path / name, with_tokenizer=True)
    tokenizer = get_tokenizer(str(path))
    text = "def add(a, b):\n    return a + b  # ünïcode"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < TINY_VOCAB_SIZE
    assert tokenizer.eos_token_id == EOS_ID

    hf_config = get_config(str(path), trust_remote_code=False)
    text_config = get_hf_text_config(hf_config)
    assert text_config.vocab_size == TINY_VOCAB_SIZE
    assert text_config.eos_token_id == EOS_ID


@pytest.mark.parametrize("name", shapes.FULL_SIZE_MODELS)
def test_full_size_record_is_shape_only(name, tmp_path):
    record = shapes.load_full_size(name)
    assert record["_source"].strip()
    assert record["architectures"] and record["model_type"]
    # _source stays out of the config.json handed to vLLM.
    path = shapes.write_full_size_config(name, tmp_path)
    assert "_source" not in (path / "config.json").read_text()
    # No weights: these directories are for planning tests only.
    assert [p.name for p in path.iterdir()] == ["config.json"]
