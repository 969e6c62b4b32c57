# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A hybridkv lm-eval job config: what to run, and how the two engines differ.

The keys follow vLLM's ``.buildkite/lm-eval-harness/configs/*.yaml`` (``model_name``,
``tasks`` with ``metrics``, ``num_fewshot``, ``limit``, ``max_model_len``,
``kv_cache_dtype``, ``rtol``...), with three differences:

* no metric carries a ``value``: nothing is compared with a number measured
  elsewhere. ``baseline`` names what the baseline engine changes (for a TurboQuant
  job, ``kv_cache_dtype: auto``), both engines run in the same job, and the
  candidate's score must be within ``rtol``/``atol`` of the baseline's;
* ``engine_args`` holds further ``vllm.LLM`` arguments (``speculative_config``,
  ``language_model_only``...), merged key by key by ``baseline.engine_args``
  (a ``null`` there removes the key for the baseline);
* ``num_fewshot`` and ``limit`` may be set per task, and a task's ``metadata``
  reaches its dataset builder (the NIAH tasks' ``context_length``, ``num_samples``).

A metric may say ``higher_is_better: false`` (``compare`` knows lm-eval's
perplexities and bits per byte as lower-is-better without it).

``model_name`` and ``tokenizer`` (the baseline's too) may hold ``${VAR}``
references to environment variables, expanded when the config is loaded: the
real-weights jobs name ``${HYBRIDKV_REAL_WEIGHTS_DIR}/<model>``, the directory
``python -m tests.models.real_weights.checkpoints DIR`` builds. An unset or empty
variable is an error, and so is an expanded absolute path that does not exist.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).parent / "tasks"

TURBOQUANT_PRESETS = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    *TURBOQUANT_PRESETS,
)
BACKENDS = ("vllm", "vllm-vlm", "dummy")

# vLLM's lm-eval-harness DEFAULT_RTOL; ours is relative to the baseline run.
DEFAULT_RTOL = 0.08
DEFAULT_ATOL = 0.0

# key -> (types, default); None as a default means "absent unless given".
_TOP_LEVEL: dict[str, tuple[tuple[type, ...], Any]] = {
    "model_name": ((str,), None),
    "tokenizer": ((str,), None),
    "backend": ((str,), "vllm"),
    "tasks": ((list,), None),
    "num_fewshot": ((int,), None),
    "limit": ((int, float), None),
    "max_model_len": ((int,), 4096),
    "kv_cache_dtype": ((str,), "auto"),
    "enforce_eager": ((bool,), False),
    "trust_remote_code": ((bool,), False),
    "add_bos_token": ((bool,), True),
    "batch_size": ((str, int), "auto"),
    "apply_chat_template": ((bool,), False),
    "fewshot_as_multiturn": ((bool,), False),
    "gen_kwargs": ((str, dict), None),
    "env_vars": ((dict,), None),
    "engine_args": ((dict,), None),
    "baseline": ((dict,), None),
    "rtol": ((int, float), DEFAULT_RTOL),
    "atol": ((int, float), DEFAULT_ATOL),
}
_REQUIRED = ("model_name", "tasks", "baseline")
# What the baseline engine may change; the tasks, limits and tolerance are shared.
_BASELINE_KEYS = (
    "kv_cache_dtype",
    "engine_args",
    "env_vars",
    "enforce_eager",
    "max_model_len",
    "tokenizer",
    "backend",
)
_TASK_KEYS = ("name", "metrics", "num_fewshot", "limit", "metadata")
_METRIC_KEYS = ("name", "rtol", "atol", "higher_is_better")

# ${NAME} in model_name / tokenizer; nothing else is expanded ($NAME stays as is).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_EXPANDED_KEYS = ("model_name", "tokenizer")
REAL_WEIGHTS_ENV = "HYBRIDKV_REAL_WEIGHTS_DIR"
_ENV_HINTS = {
    REAL_WEIGHTS_ENV: (
        "it names the directory holding the converted real-weights checkpoints "
        "(<dir>/smollm2_135m, <dir>/gemma3_270m): build them from the repository "
        "root with `python -m tests.models.real_weights.checkpoints DIR` (offline: "
        f"add --gguf PATH for each GGUF) and export {REAL_WEIGHTS_ENV}=DIR"
    ),
}


class ConfigError(ValueError):
    pass


def _fail(path: Path | str, message: str) -> None:
    raise ConfigError(f"{path}: {message}")


def _check_tolerance(path, where: str, entry: dict[str, Any]) -> None:
    for key in ("rtol", "atol"):
        if key in entry:
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(path, f"{where}{key} must be a number, found {value!r}")
            if not 0 <= value < 1:
                _fail(path, f"{where}{key} must be in [0, 1), found {value}")


def expand_env(value: str, where: str, path: Path | str = "<config>") -> str:
    """``value`` with each ``${VAR}`` replaced by the environment's value."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        found = os.environ.get(name)
        if not found:
            hint = _ENV_HINTS.get(name, f"export {name} before running the job")
            _fail(
                path,
                f"{where} {value!r} needs the environment variable {name}, which "
                f"is {'empty' if name in os.environ else 'unset'}: {hint}",
            )
        return found

    expanded = _ENV_REF.sub(sub, value)
    if expanded != value and os.path.isabs(expanded) and not os.path.exists(expanded):
        names = sorted(set(_ENV_REF.findall(value)))
        hints = [_ENV_HINTS[n] for n in names if n in _ENV_HINTS]
        _fail(
            path,
            f"{where} {value!r} expands to {expanded}, which does not exist"
            + (f"; {hints[0]}" if hints else ""),
        )
    return expanded


def task_metadata(task: dict[str, Any]) -> dict[str, Any]:
    """The task YAML's metadata (for our local tasks) overlaid with the job's."""
    merged: dict[str, Any] = {}
    task_file = TASKS_DIR / f"{task['name']}.yaml"
    if task_file.is_file():
        # Our task YAMLs use lm-eval's !function tag; only their metadata is read here.
        loader = type("_Loader", (yaml.SafeLoader,), {})
        loader.add_constructor("!function", lambda _loader, node: node.value)
        merged.update(
            (yaml.load(task_file.read_text(), Loader=loader) or {}).get("metadata", {})
        )
    merged.update(task.get("metadata") or {})
    return merged


def validate(config: dict[str, Any], path: Path | str = "<config>") -> dict[str, Any]:
    """Check ``config`` and return it with defaults filled in (a copy)."""
    if not isinstance(config, dict):
        _fail(
            path, f"expected a mapping at the top level, found {type(config).__name__}"
        )
    unknown = sorted(set(config) - set(_TOP_LEVEL))
    if unknown:
        _fail(path, f"unknown keys {unknown}; known: {sorted(_TOP_LEVEL)}")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        _fail(path, f"missing required keys {missing}")
    out = copy.deepcopy(config)
    for key, (types, default) in _TOP_LEVEL.items():
        if key in out:
            value = out[key]
            # bool is an int to isinstance(), but True is no max_model_len.
            wrong_bool = isinstance(value, bool) and bool not in types
            if wrong_bool or not isinstance(value, types):
                expected = "/".join(t.__name__ for t in types)
                _fail(path, f"{key} must be {expected}, found {value!r}")
        elif default is not None:
            out[key] = default
    for key in _EXPANDED_KEYS:
        if isinstance(out.get(key), str):
            out[key] = expand_env(out[key], key, path)
    if out["backend"] not in BACKENDS:
        _fail(path, f"backend must be one of {BACKENDS}, found {out['backend']!r}")
    _check_tolerance(path, "", out)

    if not out["tasks"]:
        _fail(path, "tasks is empty")
    for i, task in enumerate(out["tasks"]):
        where = f"tasks[{i}]"
        if not isinstance(task, dict) or not isinstance(task.get("name"), str):
            _fail(path, f"{where} must be a mapping with a string 'name'")
        if extra := sorted(set(task) - set(_TASK_KEYS)):
            _fail(
                path,
                f"{where} ({task['name']}): unknown keys {extra}; "
                f"known: {list(_TASK_KEYS)}",
            )
        metrics = task.get("metrics")
        if not isinstance(metrics, list) or not metrics:
            _fail(path, f"{where} ({task['name']}): metrics must be a non-empty list")
        for j, metric in enumerate(metrics):
            mwhere = f"{where}.metrics[{j}]"
            if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
                _fail(path, f"{mwhere} must be a mapping with a string 'name'")
            if "value" in metric:
                _fail(
                    path,
                    f"{mwhere} ({metric['name']}) has a 'value'; hybridkv jobs compare "
                    "against the baseline engine run in the same job, never against a "
                    "stored number: drop 'value' and set 'baseline'",
                )
            if extra := sorted(set(metric) - set(_METRIC_KEYS)):
                _fail(
                    path, f"{mwhere}: unknown keys {extra}; known: {list(_METRIC_KEYS)}"
                )
            _check_tolerance(path, f"{mwhere}.", metric)
            if "higher_is_better" in metric and not isinstance(
                metric["higher_is_better"], bool
            ):
                _fail(
                    path,
                    f"{mwhere}.higher_is_better must be true or false, found "
                    f"{metric['higher_is_better']!r}",
                )
        if "metadata" in task and not isinstance(task["metadata"], dict):
            _fail(path, f"{where} ({task['name']}): metadata must be a mapping")

    baseline = out["baseline"]
    if not baseline:
        _fail(
            path,
            "baseline is empty: the baseline engine must differ from the candidate",
        )
    if extra := sorted(set(baseline) - set(_BASELINE_KEYS)):
        _fail(
            path,
            f"baseline: unknown keys {extra}; "
            f"the baseline may change {list(_BASELINE_KEYS)}",
        )
    if "engine_args" in baseline and not isinstance(baseline["engine_args"], dict):
        _fail(path, "baseline.engine_args must be a mapping")
    for key in _EXPANDED_KEYS:
        if isinstance(baseline.get(key), str):
            baseline[key] = expand_env(baseline[key], f"baseline.{key}", path)
    candidate, base = side(out, "candidate"), side(out, "baseline")
    if candidate == base:
        _fail(
            path, "baseline changes nothing: both engines would run the same settings"
        )
    for role, settings in (("candidate", candidate), ("baseline", base)):
        if settings["kv_cache_dtype"] not in KV_CACHE_DTYPES:
            _fail(
                path,
                f"{role} kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"found {settings['kv_cache_dtype']!r}",
            )
    if (
        candidate["kv_cache_dtype"] in TURBOQUANT_PRESETS
        and base["kv_cache_dtype"] != "auto"
    ):
        _fail(
            path,
            f"a TurboQuant job ({candidate['kv_cache_dtype']}) compares against the "
            f"'auto' KV cache, but its baseline uses {base['kv_cache_dtype']!r}",
        )

    for role, settings in (("candidate", candidate), ("baseline", base)):
        for task in out["tasks"]:
            length = task_metadata(task).get("context_length")
            if length is not None and int(length) > settings["max_model_len"]:
                _fail(
                    path,
                    f"task {task['name']} builds prompts of up to {length} tokens, "
                    f"but the {role} engine's max_model_len is "
                    f"{settings['max_model_len']}; raise "
                    "max_model_len or drop the task",
                )
    return out


def side(config: dict[str, Any], role: str) -> dict[str, Any]:
    """The settings of one engine: ``role`` is 'candidate' or 'baseline'."""
    if role not in ("candidate", "baseline"):
        raise ValueError(f"role must be 'candidate' or 'baseline', found {role!r}")
    settings = {k: copy.deepcopy(config.get(k)) for k in _BASELINE_KEYS}
    settings["engine_args"] = settings["engine_args"] or {}
    settings["env_vars"] = settings["env_vars"] or {}
    if role == "baseline":
        for key, value in config["baseline"].items():
            if key in ("engine_args", "env_vars"):
                for k, v in (value or {}).items():
                    if v is None:
                        settings[key].pop(k, None)
                    else:
                        settings[key][k] = copy.deepcopy(v)
            else:
                settings[key] = copy.deepcopy(value)
    return settings


def model_args(config: dict[str, Any], role: str, tp_size: int) -> dict[str, Any]:
    """lm-eval's ``model_args`` for one engine (the vLLM backend passes what it does
    not know on to ``vllm.LLM``)."""
    settings = side(config, role)
    args: dict[str, Any] = {
        "pretrained": config["model_name"],
        "tensor_parallel_size": int(tp_size),
        "max_model_len": settings["max_model_len"],
        "kv_cache_dtype": settings["kv_cache_dtype"],
        "enforce_eager": settings["enforce_eager"],
        "trust_remote_code": config["trust_remote_code"],
        "add_bos_token": config["add_bos_token"],
    }
    if settings["tokenizer"]:
        args["tokenizer"] = settings["tokenizer"]
    args.update(settings["engine_args"])
    return args


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return validate(yaml.safe_load(path.read_text(encoding="utf-8")), path)


def read_config_list(list_file: str | Path) -> list[Path]:
    """The config files a ``models-*.txt`` names (one per line, '#' comments)."""
    list_file = Path(list_file)
    lines = list_file.read_text(encoding="utf-8").splitlines()
    paths = [
        list_file.parent / ln.strip()
        for ln in lines
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise ConfigError(f"{list_file}: names configs that do not exist: {missing}")
    return paths
