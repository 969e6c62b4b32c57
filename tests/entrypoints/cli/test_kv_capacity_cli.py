# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-capacity` end to end: the console script, in its own process, on a
host without a GPU and without the serving stack's packages.

The process gets no platform hint (HYBRIDKV_TEST_PLATFORM unset), as after a
plain install; uvicorn and FastAPI are made unimportable, so the command must
not import the serving stack.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.entrypoints.cli import kv_capacity

pytestmark = pytest.mark.cpu_test

GIB = 2**30
# Run `vllm` as its console script does, with the serving stack unimportable.
LAUNCH = (
    "import sys\n"
    "for name in ('uvicorn', 'fastapi', 'model_hosting_container_standards'):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


def qwen3_config(path: Path, **overrides) -> Path:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "torch_dtype": "bfloat16",
        **overrides,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def vllm(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_json_plan_without_gpu_or_serving_stack(tmp_path):
    model = qwen3_config(tmp_path / "qwen3")
    out = vllm(
        "kv-capacity", str(model), "--max-model-len", "4096",
        "--kv-cache-memory-bytes", str(GIB), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # stdout is the JSON document alone
    # 4 layers x 8 heads x 128 x 2 (K, V) x 2 bytes = 16 KiB per token.
    assert report["kv_tokens"] == GIB // (16 * 1024)
    assert report["attention_backends"] == {
        "full attention, head_size 128, KV auto": "FLASH_ATTN"
    }
    assert "Traceback" not in out.stderr


def test_bad_input_exits_nonzero_without_traceback(tmp_path):
    model = qwen3_config(tmp_path / "qwen3")
    out = vllm(
        "kv-capacity", str(model), "--max-model-len", "4096",
        "--gpu-memory-gib", "24", "--weights-gib", "8",
        "--gpu-memory-utilization", "1.5",
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    assert "--gpu-memory-utilization 1.5: must be in (0, 1]" in out.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-tp", "0"], "--tensor-parallel-size 0: must be greater than 0"),
        (["-tp", "3"], "num_key_value_heads=8 (KV heads) can be neither split"),
        (["--weights-gib", "-50"], "--weights-gib -50.0: must be greater than 0"),
        (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes 0: must be"),
        (["--kv-cache-dtype-skip-layers", "7"], "the model has 4 layers"),
    ],
)
def test_bad_inputs_one_paragraph(tmp_path, capsys, argv, expected):
    model = qwen3_config(tmp_path / "qwen3")
    memory = ["--gpu-memory-gib", "24", "--weights-gib", "8"]
    if "--kv-cache-memory-bytes" in argv:
        memory = []
    rc = kv_capacity.main([str(model), "--max-model-len", "4096", *memory, *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    message = err.strip().splitlines()[-1]
    assert message.startswith("vllm kv-capacity: error: ")
    assert expected in message


def test_missing_directory_is_not_a_hub_error(tmp_path, capsys):
    rc = kv_capacity.main(
        [
            str(tmp_path / "nope"),
            "--max-model-len",
            "4096",
            "--kv-cache-memory-bytes",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "no such directory" in err and "Repo id" not in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"model_type": "qwen3"', "config.json is not valid JSON (Expecting"),
        ("[1, 2]", "config.json holds a JSON list, expected an object"),
    ],
)
def test_a_config_that_is_not_a_json_object_is_named(tmp_path, capsys, text, expected):
    # transformers raised OSError from inside the planner: a traceback.
    (tmp_path / "config.json").write_text(text)
    rc = kv_capacity.main(
        [str(tmp_path), "--max-model-len", "4096", "--kv-cache-memory-bytes", "1"]
    )
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"vllm kv-capacity: error: MODEL_DIR {tmp_path}: its ")
    assert expected in message and "Fetch the model's config.json again" in message


def test_json_input_error_is_json(tmp_path, capsys):
    model = qwen3_config(tmp_path / "qwen3")
    rc = kv_capacity.main([str(model), "--max-model-len", "4096", "--json"])
    assert rc == 2
    assert "no memory to plan with" in json.loads(capsys.readouterr().out)["error"]


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        kv_capacity.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = kv_capacity.make_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
    assert "--gpu-memory-utilization" in text and "(0, 1]" in text


# --- issue 43: every refusal named, with its own exit status; --json is
# always one JSON document ----------------------------------------------------

# Exit statuses (README, "Planning KV-cache capacity without a GPU").
PLANNED, ENGINE_REFUSES, BAD_INPUT, UNREADABLE, PLANNER_BUG = 0, 1, 2, 3, 4


def kv_capacity_run(capsys, model, *argv, memory=("--kv-cache-memory-bytes", str(GIB))):
    rc = kv_capacity.main([str(model), "--max-model-len", "4096", *memory, *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def unreadable_config(path: Path) -> Path:
    """A model directory whose config.json exists but cannot be read."""
    model = qwen3_config(path)
    config = model / "config.json"
    if os.geteuid() == 0:
        # root reads any mode; /proc/self/mem is a file whose reads fail (EIO).
        config.unlink()
        config.symlink_to("/proc/self/mem")
    else:
        config.chmod(0)
    try:
        config.read_bytes()
    except OSError:
        return model
    pytest.skip("cannot make an unreadable config.json on this host")


@pytest.mark.parametrize(
    ("overrides", "argv", "status", "expected"),
    [
        ({"num_hidden_layers": 0}, [], BAD_INPUT, "num_hidden_layers=0"),
        ({"num_hidden_layers": -2}, [], BAD_INPUT, "num_hidden_layers=-2"),
        ({"head_dim": 0}, [], BAD_INPUT, "head_dim=0"),
        ({"head_dim": -64}, [], BAD_INPUT, "head_dim=-64"),
        ({"num_key_value_heads": "8"}, [], BAD_INPUT, "num_key_value_heads"),
        ({"num_attention_heads": "16"}, [], BAD_INPUT, "num_attention_heads"),
        ({"num_key_value_heads": 32}, [], BAD_INPUT, "is more than"),
        ({"num_key_value_heads": 3}, [], BAD_INPUT, "is not a multiple of"),
        ({"num_key_value_heads": 0}, [], BAD_INPUT, "num_key_value_heads=0"),
        (
            {},
            ["--gpu-memory-gib", "inf", "--weights-gib", "8"],
            BAD_INPUT,
            "--gpu-memory-gib inf: must be a finite number",
        ),
        (
            {},
            ["--gpu-memory-gib", "24", "--weights-gib", "nan"],
            BAD_INPUT,
            "--weights-gib nan: must be a finite number",
        ),
        (
            {},
            ["--gpu-memory-gib", "24", "--weights-gib", "8", "--overhead-gib", "inf"],
            BAD_INPUT,
            "--overhead-gib inf: must be a finite number",
        ),
        (
            {},
            ["--gpu-memory-gib", "24", "--weights-gib", "8"]
            + ["--gpu-memory-utilization", "nan"],
            BAD_INPUT,
            "--gpu-memory-utilization nan: must be a finite number",
        ),
        ({}, ["--device-capability", "99.9"], BAD_INPUT, "--device-capability 99.9"),
        ({}, ["--max-num-batched-tokens", "0"], BAD_INPUT, "--max-num-batched-tokens"),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_refusals_are_named_with_their_exit_status(
    tmp_path, capsys, overrides, argv, status, expected, as_json
):
    model = qwen3_config(tmp_path / "m", **overrides)
    memory = () if "--gpu-memory-gib" in argv else ("--kv-cache-memory-bytes", str(GIB))
    rc, out, err = kv_capacity_run(
        capsys, model, *argv, *(["--json"] if as_json else []), memory=memory
    )
    assert rc == status, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("vllm kv-capacity: error: ")
    assert expected in message
    if as_json:
        document = json.loads(out)  # exactly one JSON document
        assert document["exit_status"] == status
        assert expected in document["error"]
    else:
        assert out == ""


@pytest.mark.parametrize("as_json", [False, True])
def test_unreadable_config_has_its_own_exit_status(tmp_path, capsys, as_json):
    model = unreadable_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(capsys, model, *(["--json"] if as_json else []))
    assert rc == UNREADABLE
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"vllm kv-capacity: error: MODEL_DIR {model}: ")
    assert "cannot read" in message and "config.json" in message
    if as_json:
        assert json.loads(out)["exit_status"] == UNREADABLE
    else:
        assert out == ""


@pytest.mark.parametrize("block_size", ["16", "32", "64"])
def test_block_size_plans(tmp_path, capsys, block_size):
    """Release 27: `AssertionError: Current vLLM config is not set` for any N."""
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(capsys, model, "--block-size", block_size, "--json")
    assert rc == PLANNED, err
    report = json.loads(out)
    assert report["block_size"] == int(block_size)
    assert report["exit_status"] == PLANNED
    assert report["attention_backends"]


def test_usage_error_under_json_is_one_json_document(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    with pytest.raises(SystemExit) as e:
        kv_capacity.main([str(model), "--max-model-len", "many", "--json"])
    out, err = capsys.readouterr()
    assert e.value.code == BAD_INPUT
    document = json.loads(out)
    assert document["exit_status"] == BAD_INPUT
    assert "--max-model-len" in document["error"]
    assert "--max-model-len" in err


def test_engine_refusal_under_json_carries_its_exit_status(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(
        capsys, model, "--json", memory=("--kv-cache-memory-bytes", "4096")
    )
    assert rc == ENGINE_REFUSES
    report = json.loads(out)
    assert report["exit_status"] == ENGINE_REFUSES and report["error"]


def test_a_planner_bug_has_its_own_exit_status(tmp_path, capsys, monkeypatch):
    from vllm.v1.core import kv_cache_capacity

    def bug(request):
        raise RuntimeError("a planner bug")

    monkeypatch.setattr(kv_cache_capacity, "plan_capacity", bug)
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(capsys, model, "--json")
    assert rc == PLANNER_BUG
    assert json.loads(out)["exit_status"] == PLANNER_BUG
    assert "RuntimeError: a planner bug" in err


# --- the planner names request fields; the command line names its options ----


def test_every_request_field_the_planner_names_is_an_option():
    from vllm.v1.core import kv_cache_capacity as capacity

    options = kv_capacity.request_options()
    request_fields = {f.name for f in dataclasses.fields(capacity.CapacityRequest)}
    # An error's ``field`` is a request field; each one is an option.
    assert request_fields <= set(options), request_fields - set(options)
    # Every field named in backquotes in the planner's texts is a request
    # field, so it is mapped rather than printed as written.
    source = Path(capacity.__file__).read_text()
    named = set(kv_capacity.FIELD_IN_TEXT.findall(source))
    assert named and named <= request_fields, named - request_fields
    assert options["model"] == ("MODEL_DIR", True)
    assert options["tensor_parallel_size"] == ("--tensor-parallel-size", True)
    assert options["pristine"] == ("--pristine", False)


@pytest.mark.parametrize(
    ("argv", "memory", "expected"),
    [
        (
            ["--max-model-len", "0"],
            ("--kv-cache-memory-bytes", str(GIB)),
            "--max-model-len 0: must be greater than 0. Give the context length "
            "to plan.",
        ),
        (
            ["--draft", "{model}"],
            ("--kv-cache-memory-bytes", str(GIB)),
            "--draft {model}: needs --num-speculative-tokens N (N >= 1), the tokens "
            "the draft model proposes per step.",
        ),
        (
            ["--kv-cache-dtype-skip-layers", "3", "1"],
            ("--kv-cache-memory-bytes", str(GIB)),
            "--kv-cache-dtype-skip-layers 3 1: the KV cache is not quantized "
            "(--kv-cache-dtype auto), so every layer already stores the model "
            "dtype and the entries have no effect. Leave the option out, or give a "
            "quantized --kv-cache-dtype (fp8, turboquant_4bit_nc, ...).",
        ),
        (
            [],
            (),
            "no memory to plan with: give --kv-cache-memory-bytes (the KV-cache "
            "memory per GPU), or --gpu-memory-gib (one GPU's memory) and "
            "--weights-gib (the whole model's weights; divided by the "
            "tensor-parallel size).",
        ),
        (
            ["--weights-gib", "100"],
            ("--gpu-memory-gib", "24"),
            "nothing left for the KV cache: 24.0 GiB x 0.92 = 22.08 GiB per GPU, "
            "minus weights 100.00 GiB (--weights-gib / --tensor-parallel-size) and "
            "--overhead-gib 1.0 leaves -78.92 GiB. Use more or larger GPUs, a "
            "higher --gpu-memory-utilization, or smaller weights.",
        ),
    ],
)
def test_errors_name_options(tmp_path, capsys, argv, memory, expected):
    model = qwen3_config(tmp_path / "m")
    argv = [a.format(model=model) for a in argv]
    rc, out, err = kv_capacity_run(capsys, model, *argv, "--json", memory=memory)
    assert rc == BAD_INPUT
    assert err.strip().splitlines()[-1] == (
        f"vllm kv-capacity: error: {expected.format(model=model)}"
    )
    assert json.loads(out)["error"] == expected.format(model=model)


def test_warnings_name_options(tmp_path, capsys, caplog_vllm):
    caplog_vllm.set_level(logging.WARNING, logger="vllm")
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(
        capsys,
        model,
        "--weights-gib", "8", "--language-model-only",
        "--max-num-batched-tokens", "4096", "--json",
    )  # fmt: skip
    assert rc == PLANNED, err
    report = json.loads(out)
    warnings = [
        "--weights-gib 8.0: no effect, --kv-cache-memory-bytes gives the KV-cache "
        "memory (only --gpu-memory-gib still counts: it picks the engine's "
        "scheduler defaults).",
        "--language-model-only: no effect, the model has no multimodal encoder.",
    ]
    assert report["warnings"] == warnings
    assert report["max_num_batched_tokens_source"] == "--max-num-batched-tokens"
    logged = [
        r.getMessage() for r in caplog_vllm.records if r.name.endswith("capacity")
    ]
    assert logged == warnings


def test_new_engine_options_are_accepted(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(
        capsys,
        model,
        "--max-num-batched-tokens", "4096", "--usage-context", "llm", "--json",
    )  # fmt: skip
    assert rc == PLANNED, err
    assert json.loads(out)["max_num_batched_tokens"] == 4096


# --- issue 47: prefix caching and the Mamba cache mode ------------------------


def test_prefix_caching_flags_parse_and_are_in_help(capsys):
    parser = kv_capacity.make_parser()
    base = ["m", "--max-model-len", "1"]
    args = parser.parse_args(
        [*base, "--enable-prefix-caching", "--mamba-cache-mode", "align"]
    )
    request = kv_capacity.request_from_args(args)
    assert (request.enable_prefix_caching, request.mamba_cache_mode) == (True, "align")
    args = parser.parse_args([*base, "--no-enable-prefix-caching"])
    assert kv_capacity.request_from_args(args).enable_prefix_caching is False
    # Left out: the engine's default for the model, and vLLM's mode.
    request = kv_capacity.request_from_args(parser.parse_args(base))
    assert (request.enable_prefix_caching, request.mamba_cache_mode) == (None, None)
    options = kv_capacity.request_options()
    assert options["enable_prefix_caching"] == ("--enable-prefix-caching", False)
    assert options["mamba_cache_mode"] == ("--mamba-cache-mode", True)
    with pytest.raises(SystemExit) as e:
        kv_capacity.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "--mamba-cache-mode {all,align,none}" in text


def test_mamba_cache_modes_are_vllms():
    from typing import get_args

    from vllm.config.cache import MambaCacheMode

    assert get_args(MambaCacheMode) == kv_capacity.MAMBA_CACHE_MODES


def test_a_mode_vllm_does_not_have_is_a_usage_error(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    with pytest.raises(SystemExit) as e:
        kv_capacity_run(
            capsys, model,
            "--enable-prefix-caching", "--mamba-cache-mode", "everything", "--json",
        )  # fmt: skip
    assert e.value.code == BAD_INPUT
    document = json.loads(capsys.readouterr().out)
    assert document["error_type"] == "usage"
    assert document["error"].startswith(
        "argument --mamba-cache-mode: invalid choice: 'everything'"
    )


def test_a_mode_without_effect_names_the_flag(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(
        capsys, model, "--enable-prefix-caching", "--mamba-cache-mode", "align"
    )
    assert rc == BAD_INPUT
    assert err.strip().splitlines()[-1] == (
        "vllm kv-capacity: error: --mamba-cache-mode align: the model has no "
        "GDN/Mamba layers, so it has no effect. Leave it out."
    )


def test_hybrid_with_prefix_caching_plans_as_the_python_api(tmp_path, capsys):
    """The command, as after a plain install, plans the tiny Qwen3-Next with
    prefix caching as the Python API does, at the KV tokens the engine
    measured (PREFIX_CACHING.md: 123,736 on an H200)."""
    from tests.models.tiny_hybrids import prefix_cache_matrix as pcm
    from tests.models.tiny_hybrids import prefix_cache_plan
    from vllm.v1.core import kv_cache_capacity as capacity

    model = prefix_cache_plan.write_configs(tmp_path, {"qwen3_next"})["qwen3_next"]
    request = prefix_cache_plan.cell_request(
        pcm.Cell("qwen3_next", "auto", "none", "align"), model
    )
    argv = prefix_cache_plan.cli_argv(request)
    assert argv[-3:] == ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    out = vllm("kv-capacity", *argv, "--json")
    assert out.returncode == PLANNED, out.stderr
    report = json.loads(out.stdout)
    assert report["kv_tokens"] == capacity.plan_capacity(request).kv_tokens == 123736
    assert report["enable_prefix_caching"] is True
    assert report["mamba_cache_mode"] == "align"
    assert report["mamba_block_size"] == report["block_size"] == 80
    # Without prefix caching the mode would change nothing: refused by flag.
    rc = kv_capacity.main([*argv[:-3], "--mamba-cache-mode", "align"])
    err = capsys.readouterr().err
    assert rc == BAD_INPUT
    message = err.strip().splitlines()[-1]
    assert message.startswith(
        "vllm kv-capacity: error: --mamba-cache-mode align: a Mamba cache mode "
        "applies only with prefix caching, which is off (the engine's default "
        "for GDN/Mamba hybrids)"
    )
    assert message.endswith(
        "Turn prefix caching on with --enable-prefix-caching, or leave the mode out."
    )


# Modules a help text has no use for: the engine, its configs, the platforms,
# the model code and transformers.
HEAVY = (
    "vllm.engine",
    "vllm.config",
    "vllm.platforms",
    "vllm.model_executor",
    "vllm.v1",
    "transformers",
)


def test_help_imports_no_engine_module():
    """`vllm kv-capacity --help` only builds the argument parser. (torch is
    imported by `import vllm` itself, vllm/env_override.py, before any
    subcommand runs.)"""
    launch = LAUNCH.replace(
        "main()\n",
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith("
        f"{HEAVY!r})), file=sys.stderr)\n",
    )
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    out = subprocess.run(
        [sys.executable, "-c", launch, "kv-capacity", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "--max-num-batched-tokens" in out.stdout
    assert "LOADED []" in out.stderr, out.stderr[-2000:]
