# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gemma 4 declares mm-prefix (bidirectional image attention) per layer.

Gemma 4 with ``use_bidirectional_attention="vision"`` attends bidirectionally
over image tokens on its sliding layers only; ``gemma4_mm.py`` clears the
mm-prefix ranges of the full layers at run time. vLLM 0.20.2 still declares
mm-prefix for every layer when choosing its backend, so TurboQuant (no
mm-prefix kernel) is refused for the causal full layers:
``Selected backend AttentionBackendEnum.TURBOQUANT is not valid ... Reason:
[..., 'partial multimodal token full attention not supported']``
(vllm-project/vllm#41403, Gate 1).

The tiny Gemma 4 (sliding 256 at 0-4 and 6-10, full 512 at 5 and 11; boundary
layers 0, 1, 10, 11 keep bf16) is built layer by layer on the meta device with
``CudaPlatform`` (faked SM90 / SM120) choosing each layer's backend.
"""

import sys
import types

import pytest
import torch

from tests.models.tiny_hybrids import builders
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.cpu_test

TQ = "turboquant_4bit_nc"
SLIDING = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]


def _backend_map(tmp_path, monkeypatch, capability, **engine_kwargs):
    """layer index -> (backend name, use_mm_prefix) for every decoder layer."""
    path = builders.gemma4_mm(tmp_path / "gemma4")
    args = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=1024,
        **engine_kwargs,
    )
    config = args.create_engine_config()

    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    import vllm.platforms
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models import gemma4
    from vllm.platforms import cuda as cuda_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention import selector

    monkeypatch.setattr(
        cuda_platform.CudaPlatform,
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
    )
    monkeypatch.setattr(
        vllm.platforms, "_current_platform", cuda_platform.CudaPlatform()
    )
    # The MLP needs vLLM's CUDA ops; the attention layers are what is checked.
    monkeypatch.setattr(gemma4, "Gemma4MLP", lambda *a, **k: torch.nn.Identity())
    cuda_platform._get_backend_priorities.cache_clear()
    selector._cached_get_attn_backend.cache_clear()

    text = config.model_config.hf_text_config
    layers = {}
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{tmp_path}/dist", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            dtype = config.model_config.dtype
            with torch.device("meta"), set_default_torch_dtype(dtype):
                for i in range(text.num_hidden_layers):
                    layer = gemma4.Gemma4DecoderLayer(
                        text,
                        config.cache_config,
                        None,
                        prefix=f"model.language_model.layers.{i}",
                    )
                    attn = layer.self_attn.attn
                    layers[i] = (attn.attn_backend.get_name(), attn.use_mm_prefix)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
            cuda_platform._get_backend_priorities.cache_clear()
            selector._cached_get_attn_backend.cache_clear()
    return layers


@pytest.mark.parametrize("capability", [(9, 0), (12, 0)], ids=["sm90", "sm120"])
@pytest.mark.parametrize("flag", [None, "TURBOQUANT"], ids=["no-flag", "flag"])
def test_turboquant_serves_gemma4_full_layers_with_vision(
    tmp_path, monkeypatch, capability, flag
):
    layers = _backend_map(
        tmp_path,
        monkeypatch,
        capability,
        kv_cache_dtype=TQ,
        attention_backend=flag,
    )
    # Only the sliding layers attend bidirectionally over image tokens.
    assert {i for i, (_, mm) in layers.items() if mm} == set(SLIDING)
    # Layer 5 is the TurboQuant layer; 11 is a boundary layer (bf16, 512).
    assert layers[5] == ("TURBOQUANT", False)
    assert layers[11] == ("TRITON_ATTN", False)
    assert {layers[i][0] for i in SLIDING} == {"TRITON_ATTN"}


def test_model_without_vision_bidirectional_declares_none(tmp_path):
    path = builders.gemma4_mm(tmp_path / "g", use_bidirectional_attention=None)
    config = EngineArgs(
        model=str(path), skip_tokenizer_init=True, max_model_len=1024
    ).create_engine_config()
    assert not config.model_config.is_mm_prefix_lm


def test_capacity_planner_routes_the_causal_full_layers_like_the_engine(tmp_path):
    """`vllm kv-capacity` (0006) reports the backend the engine gives the
    TurboQuant full layer of a vision Gemma 4, not a start-up failure."""
    from vllm.v1.core import kv_cache_capacity as capacity

    path = builders.gemma4_mm(tmp_path / "gemma4")
    report = capacity.plan_capacity(
        capacity.CapacityRequest(
            model=str(path),
            max_model_len=1024,
            kv_cache_dtype=TQ,
            kv_cache_memory_bytes=2**28,
        )
    )
    assert report.error is None, report.error
    assert report.backend_errors == {}
    full_tq = f"full attention, head_size 512, KV {TQ}"
    assert report.attention_backends[full_tq] == "TURBOQUANT"
