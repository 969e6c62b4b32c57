# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine boot path of a tiny Gemma 4 multimodal model, on the CPU.

Under transformers >= 5.15 Gemma 4's ``head_dim`` / ``num_key_value_heads``
are per-layer, and any code that reads every field of the text config raises
``AmbiguousGlobalPerLayerAttributeError``. Besides the direct reads (see
test_per_layer_config.py) two generic walks do: the config hash
(``VllmConfig.compute_hash``) and the ``hf_config != hf_text_config`` check
that builds the inner ``Gemma4ForCausalLM`` (its ``hf_config`` is a copy of
the text config, so transformers' dataclass ``__eq__`` compares every field).
The second stopped the engine on an H100 under transformers 5.17.

Steps a GPU boot takes, here without a GPU: ``create_engine_config`` (both KV
dtypes), the hash, a pickle round trip (engine-core process), the model class
built on the meta device, the multimodal budget and dummy inputs (profiling),
one image+text prompt through vLLM's input preprocessor, one OpenAI chat
message with an image through the renderer `vllm serve` uses, and the
capacity planner (0006) on the same model.
"""

import pickle

import pytest
import torch
import transformers

from tests.models.tiny_hybrids import builders
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.cpu_test

SOFT_TOKENS = 70
# Layer index -> (head_dim, total KV heads): sliding 256 / 4, full 512 / 1.
FULL_LAYERS = (5, 11)


def _shape(i: int) -> tuple[int, int]:
    return (512, 1) if i in FULL_LAYERS else (256, 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    builders.gemma4_mm(
        path,
        with_tokenizer=True,
        vision_overrides={"default_output_length": SOFT_TOKENS},
    )
    return builders.write_gemma4_processor(path, SOFT_TOKENS)


def _engine_config(path, kv_cache_dtype: str):
    return EngineArgs(
        model=str(path),
        load_format="dummy",
        max_model_len=1024,
        kv_cache_dtype=kv_cache_dtype,
        limit_mm_per_prompt={"image": 1},
        mm_processor_cache_gb=0,
        enforce_eager=True,
    ).create_engine_config()


@pytest.mark.parametrize("kv_cache_dtype", ["turboquant_4bit_nc", "auto"])
def test_engine_config_hash_and_pickle(model_dir, kv_cache_dtype):
    config = _engine_config(model_dir, kv_cache_dtype)
    model_config = config.model_config
    assert model_config.get_head_size() == 512
    assert model_config.get_total_num_kv_heads() == 4
    assert model_config.get_sliding_window() == 128
    # torch.compile's cache key; walks every field of the HF configs.
    assert config.compute_hash()
    copy = pickle.loads(pickle.dumps(config))
    assert copy.model_config.get_head_size() == 512
    # What the inner language model's ModelConfig compares (0.20.2: raises).
    inner = config.with_hf_config(model_config.hf_text_config).model_config
    assert inner._get_transformers_backend_cls().startswith("Transformers")


def test_model_class_builds_on_meta(model_dir, tmp_path, monkeypatch):
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import gemma4

    # GeluAndMul binds a CUDA op at construction; shapes are what is checked.
    monkeypatch.setattr(gemma4, "GeluAndMul", lambda *a, **k: torch.nn.Identity())
    config = _engine_config(model_dir, "turboquant_4bit_nc")
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{tmp_path}/dist", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            with torch.device("meta"):
                model = initialize_model(vllm_config=config)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention) and ".layers." in name:
            i = int(name.split(".layers.")[1].split(".")[0])
            layers[i] = (module.head_size, module.num_kv_heads, module.kv_cache_dtype)
    assert sorted(layers) == list(range(12))
    for i, (head_size, kv_heads, kv_dtype) in layers.items():
        assert (head_size, kv_heads) == _shape(i), i
        # 0005: boundary layers 0, 1, 10, 11 and sliding layers keep bf16.
        assert (kv_dtype == "turboquant_4bit_nc") == (i == 5), (i, kv_dtype)


def test_multimodal_profiling_and_prompt(model_dir):
    from PIL import Image

    from vllm.inputs.preprocess import InputPreprocessor
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    config = _engine_config(model_dir, "turboquant_4bit_nc")
    with set_current_vllm_config(config):
        budget = MultiModalBudget(config, MULTIMODAL_REGISTRY)
        assert budget.mm_max_toks_per_item["image"] == SOFT_TOKENS
        dummy = MULTIMODAL_REGISTRY.get_dummy_mm_inputs(
            config.model_config, mm_counts={"image": 1}
        )
        assert len(dummy["mm_kwargs"]["image"]) == 1
        image = Image.new("RGB", (96, 64), (220, 30, 30))
        out = InputPreprocessor(config).preprocess(
            {
                "prompt": "user: <image_soft_token> what colours?\nassistant:",
                "multi_modal_data": {"image": image},
            }
        )
    (placeholder,) = out["mm_placeholders"]["image"]
    assert 0 < placeholder.length <= SOFT_TOKENS + 2
    assert len(out["prompt_token_ids"]) > placeholder.length
    print(f"transformers {transformers.__version__}: image -> {placeholder.length}")


def test_chat_request_with_image(model_dir):
    """What `vllm serve` does with one OpenAI image+text chat message."""
    import base64
    import io

    from PIL import Image

    from vllm.inputs.preprocess import InputPreprocessor
    from vllm.renderers.params import ChatParams
    from vllm.renderers.registry import renderer_from_config

    config = _engine_config(model_dir, "turboquant_4bit_nc")
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (30, 30, 220)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "text", "text": "What colours are in this image?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    with set_current_vllm_config(config):
        renderer = renderer_from_config(config)
        _, prompt = renderer.render_messages(
            [{"role": "user", "content": content}], ChatParams()
        )
        out = InputPreprocessor(config, renderer=renderer).preprocess(prompt)
    (placeholder,) = out["mm_placeholders"]["image"]
    assert 0 < placeholder.length <= SOFT_TOKENS + 2


@pytest.mark.parametrize("tp", [1, 2])
def test_capacity_planner_reads_per_layer_shapes(model_dir, tp):
    """``vllm kv-capacity`` (0006) on the same model: TP check and geometry."""
    from vllm.v1.core import kv_cache_capacity as capacity

    report = capacity.plan_capacity(
        capacity.CapacityRequest(
            model=str(model_dir),
            max_model_len=1024,
            kv_cache_dtype="turboquant_4bit_nc",
            tensor_parallel_size=tp,
            kv_cache_memory_bytes=2**28,
        )
    )
    assert report.error is None, report.error
    kinds = set(report.backend_errors) | set(report.attention_backends)
    # Sliding layers at 256 and full layers at 512 (the full KV head is
    # replicated at TP 2, not split).
    assert any(k.startswith("sliding attention, head_size 256") for k in kinds)
    assert any(k.startswith("full attention, head_size 512") for k in kinds)
    assert report.layer_dtypes == {"auto": 11, "turboquant_4bit_nc": 1}
