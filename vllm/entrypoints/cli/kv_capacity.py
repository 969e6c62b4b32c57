# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-capacity`: the command line of the KV-cache capacity planner
(vllm/v1/core/kv_cache_capacity.py).

``vllm.entrypoints.cli.main`` hands ``vllm kv-capacity ...`` to :func:`main`
before it imports the serving stack, so planning works wherever vLLM imports,
GPU or not. Exit status: 0 planned, 1 the engine would refuse the
configuration, 2 bad input.
"""

import argparse
import json
import logging
import sys
from dataclasses import asdict, fields

from vllm.entrypoints.cli.types import CLISubcommand

DESCRIPTION = (
    "Plan KV-cache groups, page sizes, padding, KV tokens, concurrency and the "
    "attention backend of each layer kind for a model config, the way the "
    "engine would at start-up on a CUDA GPU. Runs on any host, without a GPU."
)
USAGE = "vllm kv-capacity MODEL_DIR --max-model-len N [options]"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "model", metavar="MODEL_DIR", help="model directory with config.json"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        required=True,
        help="context length to plan for (tokens); concurrency is counted at it",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV-cache dtype as for `vllm serve`: auto, fp8, turboquant_4bit_nc, ...",
    )
    p.add_argument(
        "--kv-cache-dtype-skip-layers",
        nargs="*",
        default=[],
        metavar="ENTRY",
        help="layers kept at the model dtype: layer indices, 'boundary:N' (N "
        "attention layers at each end), 'draft', 'sliding_window'",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs the model is sharded over (must shard every head count evenly)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="speculative tokens per step: MTP, or the --draft model's",
    )
    p.add_argument("--draft", metavar="DIR", help="draft model directory (draft_model)")
    p.add_argument(
        "--block-size", type=int, default=None, help="as `vllm serve --block-size`"
    )
    p.add_argument(
        "--language-model-only",
        action="store_true",
        help="plan a multimodal model without its vision/audio encoders",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="as `vllm serve --attention-backend` (default: the platform's choice)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV-cache memory per GPU, as the engine's kv_cache_memory_bytes "
        "(reproduces its 'GPU KV cache size' line); replaces the GPU figures",
    )
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="one GPU's memory (GiB)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of each GPU's memory vLLM may use, in (0, 1] (default 0.9)",
    )
    p.add_argument(
        "--weights-gib",
        type=float,
        default=None,
        help="the whole model's weights (GiB); divided by the tensor-parallel size",
    )
    p.add_argument(
        "--overhead-gib",
        type=float,
        default=1.0,
        help="activations, CUDA graphs and NCCL buffers per GPU (default 1.0)",
    )
    p.add_argument(
        "--device-capability",
        default="9.0",
        help="CUDA compute capability the attention backends are chosen for "
        "(default 9.0, H100; e.g. 8.9, 12.0)",
    )
    p.add_argument(
        "--pristine",
        action="store_true",
        help="plan with upstream 0.20.2's rules (run against an unpatched install)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="write one JSON document on stdout (logs go to stderr)",
    )
    return p


def request_from_args(args: argparse.Namespace):
    from vllm.v1.core.kv_cache_capacity import CapacityRequest

    values = {f.name: getattr(args, f.name) for f in fields(CapacityRequest)}
    values["kv_cache_dtype_skip_layers"] = tuple(args.kv_cache_dtype_skip_layers)
    return CapacityRequest(**values)


def _logs_to_stderr() -> None:
    # vLLM logs to stdout by default; stdout carries the report alone.
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def run(args: argparse.Namespace) -> int:
    _logs_to_stderr()
    from vllm.v1.core.kv_cache_capacity import (
        CapacityInputError,
        check_request,
        format_report,
        plan_capacity,
        use_planning_platform,
    )

    try:
        request = request_from_args(args)
        check_request(request)
        use_planning_platform()
        report = plan_capacity(request)
    except CapacityInputError as e:
        print(f"vllm kv-capacity: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e), "input_error": True}))
        return 2
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(format_report(report))
    return 1 if report.fails else 0


def make_parser(prog: str = "vllm kv-capacity") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, usage=USAGE)
    return add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    return run(make_parser().parse_args(argv))


class KVCapacitySubcommand(CLISubcommand):
    name = "kv-capacity"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        sys.exit(run(args))

    def subparser_init(self, subparsers: argparse._SubParsersAction):
        parser = subparsers.add_parser(
            self.name, help=DESCRIPTION, description=DESCRIPTION, usage=USAGE
        )
        return add_arguments(parser)


def cmd_init() -> list[CLISubcommand]:
    return [KVCapacitySubcommand()]
