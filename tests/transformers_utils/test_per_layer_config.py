# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gemma 4 configs under transformers' per-layer layout (>= 5.15).

transformers 5.15 moved Gemma 4's ``global_head_dim`` and
``num_global_key_value_heads`` into ``per_layer_config``; vLLM 0.20.2 then
fails in ``ModelConfig`` (``AmbiguousGlobalPerLayerAttributeError`` on
``head_dim``), in ``Gemma4Config.verify_and_update_config`` and in
``Gemma4DecoderLayer``. Under transformers <= 5.14 every test here passes on
0.20.2 too; the per-layer cases are what the 5.17 / 5.23 CI step checks.
"""

from pathlib import Path

import pytest
import torch
import transformers

from tests.models.tiny_hybrids import builders
from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.config import get_config, get_hf_text_config

pytestmark = pytest.mark.cpu_test

# Model -> layer kind -> (head_dim, total KV heads), from the config files.
SHAPES = {
    "tiny": {"sliding_attention": (256, 4), "full_attention": (512, 1)},
    "Gemma-4-31B": {"sliding_attention": (256, 16), "full_attention": (512, 4)},
}


def _model_dir(name: str, tmp_path: Path) -> Path:
    if name == "tiny":
        return builders.gemma4_mm(tmp_path / name)
    return write_full_size_config(name, tmp_path / name)


def _engine_config(path: Path):
    args = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=1024,
    )
    return args.create_engine_config()


@pytest.mark.parametrize("name", list(SHAPES))
def test_layer_shapes_under_either_layout(name, tmp_path):
    from vllm.transformers_utils.per_layer_config import (
        gemma4_head_dims,
        gemma4_layer_shape,
    )

    text = get_hf_text_config(get_config(str(_model_dir(name, tmp_path)), False))
    for i, kind in enumerate(text.layer_types):
        assert gemma4_layer_shape(text, i) == SHAPES[name][kind], (i, kind)
    assert gemma4_head_dims(text) == (256, 512)


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_config_reads_gemma4(name, tmp_path):
    """0.20.2 + transformers >= 5.15: AmbiguousGlobalPerLayerAttributeError."""
    config = _engine_config(_model_dir(name, tmp_path))
    model_config = config.model_config
    assert model_config.get_head_size() == 512
    assert model_config.get_total_num_kv_heads() == SHAPES[name]["sliding_attention"][1]
    # Gemma4Config still sees the two head sizes (and picks one backend).
    assert config.attention_config.backend is not None
    assert config.attention_config.backend.name == "TRITON_ATTN"


def test_decoder_layers_get_their_own_shape(tmp_path, monkeypatch):
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models import gemma4

    # The MLP needs vLLM's CUDA ops; attention shapes are what is checked.
    monkeypatch.setattr(gemma4, "Gemma4MLP", lambda *a, **k: torch.nn.Identity())
    config = _engine_config(_model_dir("tiny", tmp_path))
    text = config.model_config.hf_text_config
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{tmp_path}/dist", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            shapes = _layer_shapes(gemma4, config, text)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    assert shapes == {i: SHAPES["tiny"][text.layer_types[i]] for i in (0, 5)}


def _layer_shapes(gemma4, config, text) -> dict[int, tuple[int, int]]:
    shapes = {}
    with torch.device("meta"):
        for i in (0, 5):
            layer = gemma4.Gemma4DecoderLayer(
                text,
                config.cache_config,
                None,
                prefix=f"model.language_model.layers.{i}",
            )
            attn = layer.self_attn
            assert attn.attn.head_size == attn.head_dim
            shapes[i] = (attn.head_dim, attn.total_num_kv_heads)
    return shapes


def test_reports_transformers_version():
    # Which layout this run exercised, for the CI log.
    from vllm.transformers_utils.per_layer_config import is_per_layer

    text = transformers.Gemma4TextConfig(num_hidden_layers=6)
    print(f"transformers {transformers.__version__}: per-layer={is_per_layer(text)}")
