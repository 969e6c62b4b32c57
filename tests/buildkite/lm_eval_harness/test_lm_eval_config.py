# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Job config schema, the shipped configs and pipeline, and the NIAH task YAMLs."""

import copy
import importlib.util

import pytest
import yaml
from hybridkv_lm_eval import config as job_config
from hybridkv_lm_eval.config import TURBOQUANT_PRESETS, ConfigError

from .conftest import HARNESS

pytestmark = pytest.mark.cpu_test

CONFIGS = HARNESS / "configs"
PIPELINE = HARNESS.parent / "hybridkv-lm-eval.yaml"


def minimal(**extra):
    config = {
        "model_name": "org/model",
        "tasks": [
            {
                "name": "gsm8k",
                "num_fewshot": 5,
                "metrics": [{"name": "exact_match,strict-match"}],
            }
        ],
        "kv_cache_dtype": "turboquant_4bit_nc",
        "baseline": {"kv_cache_dtype": "auto"},
    }
    config.update(extra)
    return config


def test_minimal_config_gets_defaults():
    config = job_config.validate(minimal())
    assert config["rtol"] == job_config.DEFAULT_RTOL
    assert config["atol"] == 0.0
    assert config["max_model_len"] == 4096
    assert config["backend"] == "vllm"


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c: c.pop("baseline"), r"missing required keys \['baseline'\]"),
        (lambda c: c.update(baselin={}), r"unknown keys \['baselin'\]"),
        (lambda c: c["tasks"][0]["metrics"][0].update(value=0.75), "has a 'value'"),
        (lambda c: c.update(baseline={}), "baseline is empty"),
        (
            lambda c: c.update(baseline={"kv_cache_dtype": "turboquant_4bit_nc"}),
            "baseline changes nothing",
        ),
        (
            lambda c: c.update(baseline={"kv_cache_dtype": "fp8"}),
            "compares against the 'auto' KV cache",
        ),
        (
            lambda c: c.update(baseline={"limit": 10}),
            r"baseline: unknown keys \['limit'\]",
        ),
        (
            lambda c: c.update(kv_cache_dtype="turboquant_5bit"),
            "candidate kv_cache_dtype must be one of",
        ),
        (lambda c: c.update(rtol=1.5), r"rtol must be in \[0, 1\)"),
        (
            lambda c: c["tasks"][0]["metrics"][0].update(atol="0.1"),
            "atol must be a number",
        ),
        (lambda c: c.update(max_model_len="4096"), "max_model_len must be int"),
        (lambda c: c.update(enforce_eager="true"), "enforce_eager must be bool"),
        (lambda c: c.update(tasks=[]), "tasks is empty"),
        (
            lambda c: c["tasks"][0].update(metrics=[]),
            "metrics must be a non-empty list",
        ),
        (lambda c: c["tasks"][0].update(fewshot=5), r"unknown keys \['fewshot'\]"),
        (lambda c: c.update(backend="hf"), "backend must be one of"),
    ],
)
def test_schema_errors(change, match):
    config = minimal()
    change(config)
    with pytest.raises(ConfigError, match=match):
        job_config.validate(config, "job.yaml")


def test_niah_context_must_fit_max_model_len():
    config = minimal(
        tasks=[{"name": "hybridkv_niah_32k", "metrics": [{"name": "niah_recall,none"}]}]
    )
    with pytest.raises(
        ConfigError,
        match="hybridkv_niah_32k builds prompts of up to 32768 tokens"
        ".*max_model_len is 4096",
    ):
        job_config.validate(config)
    job_config.validate({**config, "max_model_len": 32768})
    # A job's task metadata overrides the task YAML's.
    config["tasks"][0]["metadata"] = {"context_length": 2048}
    job_config.validate(config)


def test_baseline_merges_engine_args_and_null_removes():
    config = job_config.validate(
        minimal(
            kv_cache_dtype="auto",
            engine_args={
                "language_model_only": True,
                "speculative_config": {"method": "mtp"},
            },
            env_vars={"A": "1"},
            baseline={
                "engine_args": {"speculative_config": None},
                "env_vars": {"B": "2"},
            },
        )
    )
    assert job_config.side(config, "candidate")["engine_args"] == {
        "language_model_only": True,
        "speculative_config": {"method": "mtp"},
    }
    baseline = job_config.side(config, "baseline")
    assert baseline["engine_args"] == {"language_model_only": True}
    assert baseline["env_vars"] == {"A": "1", "B": "2"}
    # side() must not leak the baseline's changes into the config.
    assert config["engine_args"]["speculative_config"] == {"method": "mtp"}


def test_model_args():
    config = job_config.validate(
        minimal(tokenizer="org/tok", engine_args={"load_format": "dummy"})
    )
    assert job_config.model_args(config, "candidate", 2) == {
        "pretrained": "org/model",
        "tokenizer": "org/tok",
        "tensor_parallel_size": 2,
        "max_model_len": 4096,
        "kv_cache_dtype": "turboquant_4bit_nc",
        "enforce_eager": False,
        "trust_remote_code": False,
        "add_bos_token": True,
        "load_format": "dummy",
    }
    assert job_config.model_args(config, "baseline", 2)["kv_cache_dtype"] == "auto"


def test_side_rejects_unknown_role():
    with pytest.raises(ValueError, match="role must be"):
        job_config.side(job_config.validate(minimal()), "reference")


# ---- the shipped configs and pipeline ----------------------------------------------

LIST_FILES = sorted(CONFIGS.glob("models-*.txt"))
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def test_every_config_is_listed_once():
    listed = [p.name for lf in LIST_FILES for p in job_config.read_config_list(lf)]
    assert sorted(listed) == sorted(p.name for p in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.stem for p in CONFIG_FILES])
def test_shipped_config_is_valid(path):
    config = job_config.load(path)
    names = [t["name"] for t in config["tasks"]]
    assert names[0] == "gsm8k" and config["tasks"][0]["num_fewshot"] == 5
    assert "hybridkv_niah_4k" in names and "hybridkv_niah_32k" in names
    candidate, baseline = (
        job_config.side(config, "candidate"),
        job_config.side(config, "baseline"),
    )
    if candidate["kv_cache_dtype"] in TURBOQUANT_PRESETS:
        assert baseline == {**candidate, "kv_cache_dtype": "auto"}
    else:
        # The speculative-decoding jobs: the same engine without the drafter.
        assert candidate["kv_cache_dtype"] == baseline["kv_cache_dtype"] == "auto"
        assert "speculative_config" in candidate["engine_args"]
        assert "speculative_config" not in baseline["engine_args"]


@pytest.mark.parametrize("list_file", LIST_FILES, ids=[p.stem for p in LIST_FILES])
def test_each_model_list_covers_every_preset(list_file):
    configs = [job_config.load(p) for p in job_config.read_config_list(list_file)]
    presets = sorted(
        c["kv_cache_dtype"] for c in configs if c["kv_cache_dtype"] != "auto"
    )
    assert presets == sorted(TURBOQUANT_PRESETS)
    assert len({c["model_name"] for c in configs}) == 1


def _runner():
    spec = importlib.util.spec_from_file_location(
        "_hkv_lm_eval_runner", HARNESS / "test_lm_eval_correctness.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("list_file", LIST_FILES, ids=[p.stem for p in LIST_FILES])
def test_turboquant_jobs_of_a_list_share_one_baseline_run(list_file):
    runner = _runner()
    configs = [job_config.load(p) for p in job_config.read_config_list(list_file)]
    tq = [c for c in configs if c["kv_cache_dtype"] in TURBOQUANT_PRESETS]
    assert len({runner._side_key(c, "baseline", 1) for c in tq}) == 1
    assert len({runner._side_key(c, "candidate", 1) for c in tq}) == len(tq)
    # A different tensor-parallel size is a different run.
    assert runner._side_key(tq[0], "baseline", 1) != runner._side_key(
        tq[0], "baseline", 2
    )


def test_pipeline_steps_are_optional_and_name_existing_lists():
    steps = yaml.safe_load(PIPELINE.read_text())["steps"]
    blocks = {s["key"] for s in steps if "block" in s}
    commands = [s for s in steps if "commands" in s]
    assert commands and all(s["depends_on"] in blocks for s in commands)
    used = set()
    for step in commands:
        for line in step["commands"]:
            for word in line.split():
                if word.startswith("--config-list-file="):
                    path = HARNESS / word.split("=", 1)[1]
                    assert path.is_file(), f"{step['label']}: {path} does not exist"
                    used.add(path.name)
                elif word.endswith(".sh"):
                    assert (HARNESS.parent.parent / word).is_file(), word
    assert used == {p.name for p in LIST_FILES}


# ---- the NIAH task YAMLs -----------------------------------------------------------

NIAH_TASKS = sorted(
    (HARNESS / "hybridkv_lm_eval" / "tasks").glob("hybridkv_niah*.yaml")
)


@pytest.mark.parametrize("path", NIAH_TASKS, ids=[p.stem for p in NIAH_TASKS])
def test_niah_task_yaml(path):
    template = yaml.load(
        (path.parent / "_niah_template_yaml").read_text(),
        Loader=type(
            "L",
            (yaml.SafeLoader,),
            {
                "yaml_constructors": {
                    **yaml.SafeLoader.yaml_constructors,
                    "!function": lambda loader, node: node.value,
                }
            },
        ),
    )
    meta = job_config.task_metadata({"name": path.stem})
    assert yaml.safe_load(path.read_text())["task"] == path.stem
    # The prompt budget sets aside exactly what the model may generate.
    assert template["generation_kwargs"]["max_gen_toks"] == meta["max_gen_toks"]
    assert template["num_fewshot"] == 0
    suffix = path.stem.removeprefix("hybridkv_niah")
    if suffix:
        assert meta["context_length"] == int(suffix.strip("_k")) * 1024


def test_configs_do_not_share_state():
    config = job_config.validate(minimal())
    before = copy.deepcopy(config)
    job_config.model_args(config, "baseline", 1)
    assert config == before
