# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-capacity` end to end: the console script, in its own process, on a
host without a GPU and without the serving stack's packages.

The process gets no platform hint (HYBRIDKV_TEST_PLATFORM unset), as after a
plain install; uvicorn and FastAPI are made unimportable, so the command must
not import the serving stack.
"""

import json
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


def test_new_engine_options_are_accepted(tmp_path, capsys):
    model = qwen3_config(tmp_path / "m")
    rc, out, err = kv_capacity_run(
        capsys,
        model,
        "--max-num-batched-tokens", "4096", "--usage-context", "llm", "--json",
    )  # fmt: skip
    assert rc == PLANNED, err
    assert json.loads(out)["max_num_batched_tokens"] == 4096


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
