# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-capacity`: the KV-cache capacity planner (vllm/v1/core/kv_cache_capacity.py)."""

import argparse
import sys

from vllm.entrypoints.cli.types import CLISubcommand


class KVCapacitySubcommand(CLISubcommand):
    name = "kv-capacity"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        from vllm.v1.core.kv_cache_capacity import run

        sys.exit(run(args))

    def subparser_init(self, subparsers: argparse._SubParsersAction):
        from vllm.v1.core.kv_cache_capacity import add_arguments

        parser = subparsers.add_parser(
            self.name,
            help="Plan KV-cache groups, page sizes and capacity without a GPU.",
            description="Plan KV-cache groups, page sizes, padding, KV tokens and "
            "concurrency for a model config the way the engine would at start-up.",
            usage="vllm kv-capacity MODEL_DIR --max-model-len N [options]",
        )
        return add_arguments(parser)


def cmd_init() -> list[CLISubcommand]:
    return [KVCapacitySubcommand()]
