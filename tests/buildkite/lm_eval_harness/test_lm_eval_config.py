# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Job config schema, the shipped configs and pipeline, and the local task YAMLs."""

import copy
import importlib.util
import re

import pytest
import yaml
from hybridkv_lm_eval import config as job_config
from hybridkv_lm_eval.config import TURBOQUANT_PRESETS, ConfigError

from .conftest import HARNESS

pytestmark = pytest.mark.cpu_test

CONFIGS = HARNESS / "configs"
PIPELINE = HARNESS.parent / "hybridkv-lm-eval.yaml"
REAL_WEIGHTS_LIST = CONFIGS / "models-real-weights.txt"
# The checkpoint directory each real-weights model's jobs name, and its context.
REAL_MODELS = {"smollm2_135m": 8192, "gemma3_270m": 32768}


@pytest.fixture(autouse=True)
def real_weights_dir(tmp_path, monkeypatch):
    """A stand-in for the built checkpoints: the real-weights configs expand
    ${HYBRIDKV_REAL_WEIGHTS_DIR}/<model> and want that directory to exist."""
    for name in REAL_MODELS:
        (tmp_path / "ckpt" / name).mkdir(parents=True)
    monkeypatch.setenv(job_config.REAL_WEIGHTS_ENV, str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


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
        (
            lambda c: c["tasks"][0]["metrics"][0].update(higher_is_better="no"),
            "higher_is_better must be true or false",
        ),
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


def test_metric_direction_is_accepted():
    config = minimal()
    config["tasks"][0]["metrics"][0]["higher_is_better"] = False
    assert (
        job_config.validate(config)["tasks"][0]["metrics"][0]["higher_is_better"]
        is False
    )


# ---- ${VAR} in model_name / tokenizer ----------------------------------------------


def test_env_reference_expands(real_weights_dir):
    config = job_config.validate(
        minimal(
            model_name="${HYBRIDKV_REAL_WEIGHTS_DIR}/smollm2_135m",
            tokenizer="${HYBRIDKV_REAL_WEIGHTS_DIR}/gemma3_270m",
        )
    )
    assert config["model_name"] == str(real_weights_dir / "smollm2_135m")
    assert config["tokenizer"] == str(real_weights_dir / "gemma3_270m")
    args = job_config.model_args(config, "baseline", 1)
    assert args["pretrained"] == str(real_weights_dir / "smollm2_135m")


def test_env_reference_in_the_baseline_tokenizer(real_weights_dir):
    config = job_config.validate(
        minimal(
            baseline={
                "kv_cache_dtype": "auto",
                "tokenizer": "${HYBRIDKV_REAL_WEIGHTS_DIR}/gemma3_270m",
            }
        )
    )
    assert job_config.side(config, "baseline")["tokenizer"] == str(
        real_weights_dir / "gemma3_270m"
    )


def test_unset_real_weights_dir_says_how_to_build(monkeypatch):
    monkeypatch.delenv(job_config.REAL_WEIGHTS_ENV)
    with pytest.raises(
        ConfigError,
        match=r"job.yaml: model_name '\$\{HYBRIDKV_REAL_WEIGHTS_DIR\}/smollm2_135m' "
        r"needs the environment variable HYBRIDKV_REAL_WEIGHTS_DIR, which is unset"
        r".*python -m tests.models.real_weights.checkpoints DIR",
    ):
        job_config.validate(
            minimal(model_name="${HYBRIDKV_REAL_WEIGHTS_DIR}/smollm2_135m"), "job.yaml"
        )


def test_empty_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("HKV_TEST_EMPTY", "")
    with pytest.raises(ConfigError, match="HKV_TEST_EMPTY, which is empty"):
        job_config.validate(minimal(model_name="${HKV_TEST_EMPTY}/m"))


def test_other_unset_variable_names_itself(monkeypatch):
    monkeypatch.delenv("HKV_TEST_UNSET", raising=False)
    with pytest.raises(
        ConfigError, match=r"HKV_TEST_UNSET, which is unset: export HKV_TEST_UNSET"
    ):
        job_config.validate(minimal(model_name="${HKV_TEST_UNSET}/m"))


def test_expanded_path_must_exist(real_weights_dir):
    with pytest.raises(
        ConfigError,
        match=rf"expands to {re.escape(str(real_weights_dir))}/qwen, which does not "
        r"exist; .*tests.models.real_weights.checkpoints",
    ):
        job_config.validate(minimal(model_name="${HYBRIDKV_REAL_WEIGHTS_DIR}/qwen"))


def test_only_braced_references_expand(monkeypatch):
    monkeypatch.setenv("ORG", "someone")
    # A hub name keeps a bare $ as it is, and nothing is checked on disk.
    assert job_config.validate(minimal(model_name="$ORG/model"))["model_name"] == (
        "$ORG/model"
    )
    assert job_config.validate(minimal(model_name="${ORG}/model"))["model_name"] == (
        "someone/model"
    )


def test_side_rejects_unknown_role():
    with pytest.raises(ValueError, match="role must be"):
        job_config.side(job_config.validate(minimal()), "reference")


# ---- the shipped configs and pipeline ----------------------------------------------

LIST_FILES = sorted(CONFIGS.glob("models-*.txt"))
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))
REAL_WEIGHTS_CONFIGS = job_config.read_config_list(REAL_WEIGHTS_LIST)
HUB_CONFIGS = [p for p in CONFIG_FILES if p not in REAL_WEIGHTS_CONFIGS]
HUB_LISTS = [p for p in LIST_FILES if p != REAL_WEIGHTS_LIST]


def test_every_config_is_listed_once():
    listed = [p.name for lf in LIST_FILES for p in job_config.read_config_list(lf)]
    assert sorted(listed) == sorted(p.name for p in CONFIG_FILES)


@pytest.mark.parametrize("path", HUB_CONFIGS, ids=[p.stem for p in HUB_CONFIGS])
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


@pytest.mark.parametrize("list_file", HUB_LISTS, ids=[p.stem for p in HUB_LISTS])
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


@pytest.mark.parametrize("list_file", HUB_LISTS, ids=[p.stem for p in HUB_LISTS])
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
                    script = HARNESS.parent.parent / word
                    assert script.is_file(), word
                    # A script runs the lists it names (configs/models-*.txt).
                    for name in re.findall(
                        r"configs/(models-[\w.-]+\.txt)", script.read_text()
                    ):
                        assert (CONFIGS / name).is_file(), f"{word}: {name}"
                        used.add(name)
    assert used == {p.name for p in LIST_FILES}


def test_real_weights_step_builds_checkpoints_first():
    steps = yaml.safe_load(PIPELINE.read_text())["steps"]
    (step,) = [
        s
        for s in steps
        if any("run-lm-eval-real-weights.sh" in c for c in s.get("commands", []))
    ]
    build, run = step["commands"]
    outdir = build.split("python -m tests.models.real_weights.checkpoints ", 1)[
        1
    ].split()[0]
    assert f"{job_config.REAL_WEIGHTS_ENV}={outdir} " in run


# ---- the real-weights jobs ---------------------------------------------------------


def test_real_weights_list_names_every_real_weights_config():
    named = {p.name for p in REAL_WEIGHTS_CONFIGS}
    mentioning = {
        p.name for p in CONFIG_FILES if job_config.REAL_WEIGHTS_ENV in p.read_text()
    }
    assert named == mentioning and len(named) == 10


@pytest.mark.parametrize(
    "path", REAL_WEIGHTS_CONFIGS, ids=[p.stem for p in REAL_WEIGHTS_CONFIGS]
)
def test_real_weights_config(path, real_weights_dir):
    config = job_config.load(path)
    model = config["model_name"].removeprefix(str(real_weights_dir) + "/")
    assert model in REAL_MODELS
    assert config["max_model_len"] == REAL_MODELS[model]
    candidate, baseline = (
        job_config.side(config, "candidate"),
        job_config.side(config, "baseline"),
    )
    assert baseline == {**candidate, "kv_cache_dtype": "auto"}
    assert candidate["kv_cache_dtype"] in (*TURBOQUANT_PRESETS, "fp8")
    assert candidate["enforce_eager"] is True
    # Engines share a GPU: a fixed KV budget, a small start-up memory check.
    engine = candidate["engine_args"]
    assert isinstance(engine["kv_cache_memory_bytes"], int)
    assert engine["gpu_memory_utilization"] <= 0.1
    names = [t["name"] for t in config["tasks"]]
    assert names[0] == "hybridkv_niah_4k" and names[-1] == "hybridkv_corpus_ppl"
    if model == "gemma3_270m":
        assert "hybridkv_niah_32k" in names
    for task in config["tasks"]:
        meta = job_config.task_metadata(task)
        if task["name"].startswith("hybridkv_niah"):
            assert meta["num_samples"] == 40
            assert meta["context_length"] <= config["max_model_len"]
    (ppl,) = [t for t in config["tasks"] if t["name"] == "hybridkv_corpus_ppl"]
    assert [m["name"] for m in ppl["metrics"]] == [
        "word_perplexity,none",
        "bits_per_byte,none",
    ]
    assert all(compare_direction(m) is False for m in ppl["metrics"])
    assert all("rtol" in m and "atol" in m for m in ppl["metrics"])
    # The presets the project targets are held to the target (README of the
    # harness): token perplexity <= 1.02x auto, recall >= auto - 5 points.
    if candidate["kv_cache_dtype"] in ("turboquant_k8v4", "turboquant_4bit_nc"):
        assert [(m["rtol"], m["atol"]) for m in ppl["metrics"]] == [
            (0.028, 0.0), (0.0075, 0.0)
        ]  # fmt: skip
        assert (config["rtol"], config["atol"]) == (0.0, 0.05)


def compare_direction(metric):
    from hybridkv_lm_eval.compare import higher_is_better

    return higher_is_better(metric)


def test_real_weights_jobs_cover_every_preset_per_model():
    by_model = {}
    for path in REAL_WEIGHTS_CONFIGS:
        config = job_config.load(path)
        by_model.setdefault(config["model_name"], []).append(config["kv_cache_dtype"])
    assert len(by_model) == 2
    for presets in by_model.values():
        assert sorted(presets) == sorted((*TURBOQUANT_PRESETS, "fp8"))


def test_real_weights_jobs_share_one_baseline_per_model():
    runner = _runner()
    configs = [job_config.load(p) for p in REAL_WEIGHTS_CONFIGS]
    baselines = {runner._side_key(c, "baseline", 1) for c in configs}
    candidates = {runner._side_key(c, "candidate", 1) for c in configs}
    assert len(baselines) == 2 and len(candidates) == len(configs)


def test_real_weights_configs_need_the_variable(monkeypatch):
    monkeypatch.delenv(job_config.REAL_WEIGHTS_ENV)
    for path in REAL_WEIGHTS_CONFIGS:
        with pytest.raises(ConfigError, match=f"{path.name}: model_name .*unset"):
            job_config.load(path)


# ---- the local task YAMLs ----------------------------------------------------------


def _task_yaml(path):
    return yaml.load(
        path.read_text(),
        Loader=type(
            "L",
            (yaml.SafeLoader,),
            {
                "yaml_constructors": {
                    **yaml.SafeLoader.yaml_constructors,
                    "!function": lambda loader, node: f"!function {node.value}",
                }
            },
        ),
    )


def test_corpus_task_yaml():
    task = _task_yaml(
        HARNESS / "hybridkv_lm_eval" / "tasks" / "hybridkv_corpus_ppl.yaml"
    )
    assert task["task"] == "hybridkv_corpus_ppl"
    assert task["output_type"] == "loglikelihood_rolling"
    assert task["custom_dataset"] == "!function corpus.build_dataset"
    assert task["num_fewshot"] == 0
    assert task["doc_to_text"] == ""
    # A row key: lm-eval returns the document's text as it is (no template).
    assert task["doc_to_target"] == "text"
    assert [m["metric"] for m in task["metric_list"]] == [
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
    ]
    assert job_config.task_metadata({"name": "hybridkv_corpus_ppl"})["max_words"] > 0


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
