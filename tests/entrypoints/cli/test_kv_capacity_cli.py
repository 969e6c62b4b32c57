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
