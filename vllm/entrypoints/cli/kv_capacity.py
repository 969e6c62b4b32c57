# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-capacity`: the command line of the KV-cache capacity planner
(vllm/v1/core/kv_cache_capacity.py).

``vllm.entrypoints.cli.main`` hands ``vllm kv-capacity ...`` to :func:`main`
before it imports the serving stack, so planning works wherever vLLM imports,
GPU or not. Building the parser and printing ``--help`` import nothing of the
engine: the planner module is imported when a plan is asked for.

Exit status (one per kind of outcome; README has the table): 0 planned, 1 the
engine would refuse the configuration, 2 bad input (a command-line value, or
a config.json value no model the engine builds has), 3 a model file that
cannot be read, 4 a bug of the planner. With ``--json``, stdout is exactly one
JSON document whatever the outcome, and carries ``exit_status``.

The planner names ``CapacityRequest`` fields (``CapacityInputError.field``,
and `field` in backquotes in its texts); this command names each by its
option, as :func:`add_arguments` defines it (``request_options``).
"""

import argparse
import contextlib
import functools
import json
import logging
import re
import sys
import traceback
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

from vllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_capacity import CapacityInputError

PLANNED = 0
ENGINE_REFUSES = 1
BAD_INPUT = 2
UNREADABLE = 3
PLANNER_BUG = 4

DESCRIPTION = (
    "Plan KV-cache groups, page sizes, padding, KV tokens, concurrency and the "
    "attention backend of each layer kind for a model config, the way the "
    "engine would at start-up on a CUDA GPU. Runs on any host, without a GPU."
)
USAGE = "vllm kv-capacity MODEL_DIR --max-model-len N [options]"
# A request field as the planner's texts name it; ``x`` is a reST literal.
FIELD_IN_TEXT = re.compile(r"(?<!`)`([a-z][a-z0-9_]*)`(?!`)")
# vLLM's MambaCacheMode (vllm/config/cache.py), written out: importing it
# would load the engine's configs, which --help must not. The planner checks
# a mode against vLLM's own list, so a drift is refused, not planned.
MAMBA_CACHE_MODES = ("all", "align", "none")


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
        "attention layers at each end), 'draft', 'sliding_window'; with a "
        "TurboQuant dtype also 'N=PRESET' (layer N's own preset), "
        "'sliding_window=DTYPE' (sliding-window layers in fp8, "
        "int8_per_token_head or fp8_per_token_head) and 'recent:W'",
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
        default=None,
        help="share of each GPU's memory vLLM may use, in (0, 1] (default: "
        "vLLM's, 0.92)",
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
        default=None,
        help="activations, CUDA graphs and NCCL buffers per GPU (default 1.0)",
    )
    p.add_argument(
        "--device-capability",
        default="9.0",
        help="CUDA compute capability the attention backends are chosen for "
        "(default 9.0, H100; e.g. 8.9, 12.0)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="as `vllm serve --max-num-batched-tokens` (default: the engine's "
        "for the GPU, by --gpu-memory-gib, --device-capability and "
        "--usage-context); sliding-window layers hold window - 1 + this many "
        "tokens per request",
    )
    p.add_argument(
        "--usage-context",
        choices=("serve", "llm"),
        default="serve",
        help="whose defaults to plan: `vllm serve` (default) or the Python LLM "
        "class; they differ in max_num_batched_tokens",
    )
    p.add_argument(
        "--mamba-cache-dtype",
        default="auto",
        help="as `vllm serve --mamba-cache-dtype`: GDN/Mamba state dtype "
        "(auto, float32, float16)",
    )
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="as `vllm serve --mamba-ssm-cache-dtype`: GDN/Mamba SSM (temporal) "
        "state dtype (auto: the model's or --mamba-cache-dtype)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="as `vllm serve --enable-prefix-caching`: plan with prefix caching "
        "on (or off); default: the engine's for the model, on for "
        "attention-only models and off for GDN/Mamba hybrids",
    )
    p.add_argument(
        "--mamba-cache-mode",
        choices=MAMBA_CACHE_MODES,
        default=None,
        help="as `vllm serve --mamba-cache-mode`, with --enable-prefix-caching "
        "only: which GDN/Mamba states prefix caching keeps (all: the state at "
        "every block boundary; align: where a scheduler step ends on one). "
        "Default: vLLM's choice; the report names the mode the engine ends with",
    )
    p.add_argument(
        "--pristine",
        action="store_true",
        help="plan with upstream 0.20.2's rules: only against an unpatched "
        "install (refused on a patched one, whose engine plans with the "
        "series' rules)",
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


@functools.cache
def request_options() -> dict[str, tuple[str, bool]]:
    """Each argument's ``dest`` (the ``CapacityRequest`` field it fills) ->
    (its name on the command line, whether a value follows it)."""
    options = {}
    for action in add_arguments(argparse.ArgumentParser(add_help=False))._actions:
        if action.option_strings:
            name = next(o for o in action.option_strings if o.startswith("--"))
        else:
            name = action.metavar or action.dest
        options[action.dest] = (name, action.nargs != 0)
    return options


def cli_text(text: str) -> str:
    """A planner text with each request field named by its option."""
    options = request_options()
    return FIELD_IN_TEXT.sub(
        lambda m: options[m[1]][0] if m[1] in options else m[0], text
    )


def cli_message(error: "CapacityInputError") -> str:
    """A ``CapacityInputError`` as the command line words it: ``--option
    value: body``."""
    body = cli_text(error.body)
    if error.field is None:
        return body
    name, takes_value = request_options()[error.field]
    if not takes_value:
        return f"{name}: {body}"
    value = error.value
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    return f"{name} {value}: {body}"


class _OptionNames(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = cli_text(record.getMessage()), None
        return True


@contextlib.contextmanager
def _options_in_logs(logger: logging.Logger):
    """The planner logs its warnings too: there they name options, as in the
    report, for this command only."""
    names = _OptionNames()
    logger.addFilter(names)
    try:
        yield
    finally:
        logger.removeFilter(names)


def _logs_to_stderr() -> None:
    # vLLM logs to stdout by default; stdout carries the report alone.
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _fail(args: argparse.Namespace, message: str, status: int, kind: str) -> int:
    print(f"vllm kv-capacity: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps(_error_document(message, status, kind)))
    return status


def _error_document(message: str, status: int, kind: str) -> dict:
    return {
        "error": message,
        "error_type": kind,
        "input_error": status in (BAD_INPUT, UNREADABLE),
        "exit_status": status,
    }


def run(args: argparse.Namespace) -> int:
    _logs_to_stderr()
    from vllm.v1.core import kv_cache_capacity as capacity

    try:
        # stdout carries the report alone: whatever else prints goes to stderr.
        with contextlib.redirect_stdout(sys.stderr), _options_in_logs(capacity.logger):
            report = capacity.plan_capacity(request_from_args(args))
    except capacity.CapacityInputError as e:
        return _fail(args, cli_message(e), e.exit_status, e.kind)
    except OSError as e:
        # A file the engine reads besides config.json.
        return _fail(
            args,
            f"cannot read {e.filename or 'a model file'}: {e.strerror or e}. Make "
            "the model directory readable by this user.",
            UNREADABLE,
            "unreadable",
        )
    except Exception as e:
        traceback.print_exc()
        return _fail(
            args,
            f"the planner failed: {type(e).__name__}: {e}. This is a bug of the "
            "planner, not a finding about the configuration; please report it "
            "with the command line.",
            PLANNER_BUG,
            "planner_bug",
        )
    report.warnings = [cli_text(w) for w in report.warnings]
    report.max_num_batched_tokens_source = cli_text(
        report.max_num_batched_tokens_source
    )
    status = ENGINE_REFUSES if report.fails else PLANNED
    if args.json:
        document = asdict(report)
        document["error_type"] = "engine_refuses" if report.fails else None
        document["exit_status"] = status
        print(json.dumps(document, allow_nan=False))
    else:
        print(capacity.format_report(report))
    return status


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are also one JSON document on stdout when
    --json was asked for."""

    json_requested = False

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        # argparse takes any unambiguous prefix of an option (--js).
        self.json_requested = any(
            a.startswith("--j") and "--json".startswith(a) for a in argv
        )
        return super().parse_args(argv, namespace)

    def error(self, message: str):  # type: ignore[override]
        if self.json_requested:
            print(json.dumps(_error_document(message, BAD_INPUT, "usage")))
        self.print_usage(sys.stderr)
        self.exit(BAD_INPUT, f"{self.prog}: error: {message}\n")


def make_parser(prog: str = "vllm kv-capacity") -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog=prog, description=DESCRIPTION, usage=USAGE)
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
