# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm --version` and `vllm [SUBCOMMAND] --help` on a host without a GPU.

Both build every subcommand's parser first, and the serve parser computes its
option defaults from `VllmConfig`, whose `DeviceConfig` asks the current
platform for a device type. On a host where no platform is detected (a laptop
planning a deployment, a CI runner, a container without the driver) that is
`UnspecifiedPlatform` and the command dies with "Failed to infer device type"
before printing anything. Those invocations run no model, so the defaults are
computed on the CPU platform instead, as `vllm bench` already does. Commands
that do run something keep failing on an unspecified platform.
"""

HELP_FLAGS = ("-h", "--help")
VERSION_FLAGS = ("-v", "--version")


def prints_only(argv: list[str]) -> bool:
    """True where argparse prints help or the version and exits: `vllm` alone,
    `--version` before any subcommand, `--help` (or vLLM's `--help=GROUP`)
    anywhere."""
    if not argv or argv[0] in VERSION_FLAGS:
        return True
    return any(arg in HELP_FLAGS or arg.startswith("--help=") for arg in argv)


def use_cpu_platform_to_print(argv: list[str]) -> None:
    if not prints_only(argv):
        return
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
