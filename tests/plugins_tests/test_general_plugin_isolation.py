# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A broken or drifted general plugin is named, skipped, or fails start-up clearly.

Seed (Gate 3 of the Gemma 4 TurboQuant report): turboquant-vllm 1.5.0's
general plugin wraps ``Attention.get_kv_cache_spec`` and copies every spec's
fields into its own ``TQ4FullAttentionSpec``; vLLM 0.20.2's TurboQuant spec
has a ``tq_slot_size`` field that class lacks, so a worker dies with
``TypeError: TQ4FullAttentionSpec.__init__() got an unexpected keyword
argument 'tq_slot_size'`` and nothing names the plugin.
"""

import logging
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import vllm.plugins
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import TQFullAttentionSpec

pytestmark = pytest.mark.cpu_test

SEED_ERROR = (
    "TQ4FullAttentionSpec.__init__() got an unexpected keyword argument 'tq_slot_size'"
)

PLUGIN_MODULE = '''
import dataclasses

import torch

from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclasses.dataclass(frozen=True)
class TQ4FullAttentionSpec(FullAttentionSpec):
    """The plugin's spec, written against a vLLM without tq_slot_size."""


def register_tq4_backend():
    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if isinstance(spec, FullAttentionSpec):
            fields = {f.name: getattr(spec, f.name)
                      for f in dataclasses.fields(spec) if f.name != "dtype"}
            return TQ4FullAttentionSpec(**fields, dtype=torch.uint8)
        return spec

    Attention.get_kv_cache_spec = get_kv_cache_spec


def register_broken():
    Attention.get_kv_cache_spec = None  # half-way, then fails
    raise ImportError("cannot import name 'spec_manager_map'")
'''


def install_fake_plugin(path, entry_point: str) -> None:
    """A real distribution on sys.path, found by importlib.metadata like pip's."""
    (path / "fake_tq4_plugin.py").write_text(PLUGIN_MODULE)
    info = path / "turboquant_vllm_fake-1.5.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: turboquant-vllm-fake\nVersion: 1.5.0\n"
    )
    (info / "entry_points.txt").write_text(
        textwrap.dedent(f"""\
        [vllm.general_plugins]
        tq4_backend = {entry_point}
        """)
    )


@pytest.fixture
def vllm_logs(caplog_vllm):
    caplog_vllm.set_level(logging.WARNING, logger="vllm")
    return caplog_vllm


@pytest.fixture
def fresh_plugins(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    # Restored after the test, whatever the plugin did to it.
    monkeypatch.setattr(Attention, "get_kv_cache_spec", Attention.get_kv_cache_spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("VLLM_PLUGINS", "VLLM_PLUGINS_STRICT", "VLLM_PLUGIN_FAILURES_REPORTED"):
        monkeypatch.delenv(var, raising=False)
    # Each test imports its own copy of the plugin module, from its own tmp_path.
    sys.modules.pop("fake_tq4_plugin", None)
    yield tmp_path
    sys.modules.pop("fake_tq4_plugin", None)


def turboquant_layer():
    return types.SimpleNamespace(
        attn_type=AttentionType.DECODER,
        kv_cache_dtype="turboquant_4bit_nc",
        sliding_window=None,
        num_kv_heads=2,
        head_size=128,
        head_size_v=128,
        kv_cache_torch_dtype=torch.uint8,
    )


def kv_cache_spec_of_a_turboquant_layer():
    config = VllmConfig()
    config.cache_config.block_size = 16
    return Attention.get_kv_cache_spec(turboquant_layer(), config)


def test_drifted_plugin_is_named_and_vllm_falls_back(fresh_plugins, vllm_logs):
    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_tq4_backend")
    vllm.plugins.load_general_plugins()

    spec = kv_cache_spec_of_a_turboquant_layer()  # pristine: the seed TypeError

    assert type(spec) is TQFullAttentionSpec and spec.tq_slot_size > 0
    text = "\n".join(r.getMessage() for r in vllm_logs.records)
    assert (
        "general plugin 'tq4_backend'" in text and "turboquant-vllm-fake 1.5.0" in text
    )
    assert "replaced vLLM core hook" in text and "Attention.get_kv_cache_spec" in text
    assert SEED_ERROR in text and "Falling back to vLLM's own hook" in text
    assert "pip uninstall turboquant-vllm-fake" in text and "VLLM_PLUGINS=" in text


def test_specs_the_plugin_already_built_are_not_kept(fresh_plugins, vllm_logs):
    from vllm.plugins.hook_watch import retry_without_failed_plugins
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_tq4_backend")
    vllm.plugins.load_general_plugins()
    config = VllmConfig()
    config.cache_config.block_size = 16
    # A boundary layer kept at bf16 (the plugin's hook succeeds on it), then a
    # TurboQuant layer (it fails): the first result must not survive.
    bf16 = types.SimpleNamespace(
        **{
            **vars(turboquant_layer()),
            "kv_cache_dtype": "auto",
            "kv_cache_torch_dtype": torch.bfloat16,
        }
    )
    layers = {"layers.0": bf16, "layers.2": turboquant_layer()}

    @retry_without_failed_plugins
    def get_kv_cache_spec():  # what GPUModelRunner.get_kv_cache_spec does
        return {
            n: Attention.get_kv_cache_spec(layer, config) for n, layer in layers.items()
        }

    specs = get_kv_cache_spec()

    assert (
        type(specs["layers.0"]) is FullAttentionSpec
        and specs["layers.0"].dtype == torch.bfloat16
    )
    assert type(specs["layers.2"]) is TQFullAttentionSpec
    assert hasattr(
        GPUModelRunner.get_kv_cache_spec, "__wrapped__"
    )  # the runner retries too


def test_drifted_plugin_fails_named_in_strict_mode(fresh_plugins, monkeypatch):
    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_tq4_backend")
    monkeypatch.setenv("VLLM_PLUGINS_STRICT", "1")
    vllm.plugins.load_general_plugins()

    with pytest.raises(RuntimeError) as exc:
        kv_cache_spec_of_a_turboquant_layer()

    msg = str(exc.value)
    assert "replaced by general plugin 'tq4_backend'" in msg and SEED_ERROR in msg
    assert "pip uninstall turboquant-vllm-fake" in msg
    assert isinstance(exc.value.__cause__, TypeError)


def test_plugin_that_fails_to_register_is_skipped_and_undone(fresh_plugins, vllm_logs):
    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_broken")
    original = Attention.get_kv_cache_spec

    vllm.plugins.load_general_plugins()  # pristine: the plugin's ImportError

    assert Attention.get_kv_cache_spec is original  # its half-done patch is undone
    text = "\n".join(r.getMessage() for r in vllm_logs.records)
    assert "general plugin 'tq4_backend' (fake_tq4_plugin:register_broken)" in text
    assert "turboquant-vllm-fake 1.5.0 failed to register: ImportError" in text
    assert "Skipped it." in text


def test_plugin_named_in_vllm_plugins_must_register(fresh_plugins, monkeypatch):
    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_broken")
    monkeypatch.setenv("VLLM_PLUGINS", "tq4_backend")
    with pytest.raises(
        RuntimeError, match=r"failed to register: ImportError.*named in VLLM_PLUGINS"
    ):
        vllm.plugins.load_general_plugins()


def test_a_failure_is_reported_once_per_process_tree(
    fresh_plugins, vllm_logs, monkeypatch
):
    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_broken")
    vllm.plugins.load_general_plugins()
    # What an engine-core or worker process inherits from the one that reported.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()

    failures = [r for r in vllm_logs.records if "failed to register" in r.getMessage()]
    assert len(failures) == 1


@pytest.mark.gpu
def test_tiny_qwen3_with_turboquant_boots_with_the_drifted_plugin(
    fresh_plugins, monkeypatch
):
    import os

    from tests.models.tiny_hybrids import qwen3_dense
    from vllm import LLM, SamplingParams

    install_fake_plugin(fresh_plugins, "fake_tq4_plugin:register_tq4_backend")
    # The engine core and workers are new processes: they find the plugin the
    # way an installed one is found, through their sys.path.
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(fresh_plugins), os.environ.get("PYTHONPATH", "")]),
    )
    model = qwen3_dense(fresh_plugins / "qwen3")  # TurboQuant on layers 2 and 3
    llm = LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype="turboquant_4bit_nc",
        max_model_len=512,
        # A fixed KV budget: engines of other tests may share the GPU, and a
        # memory profile would count their allocations as this one's.
        kv_cache_memory_bytes=256 * 2**20,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        seed=0,
    )
    out = llm.generate(
        [{"prompt_token_ids": list(range(10, 42))}],
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    )
    print(f"with the drifted plugin: generated {out[0].outputs[0].token_ids}")
    assert len(out[0].outputs[0].token_ids) == 16
    del llm


def test_isolation_and_hook_watch_import_one_way():
    """hook_watch builds on isolation; isolation must not import hook_watch back."""
    import ast

    import vllm.plugins.isolation as isolation

    tree = ast.parse(Path(isolation.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "vllm.plugins.hook_watch" not in imported
