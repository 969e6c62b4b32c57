# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run general plugins so that one broken plugin cannot take the engine down unnamed.

A ``vllm.general_plugins`` entry point runs in every vLLM process. A plugin
installed long ago for another vLLM version used to abort start-up with its
own traceback, or -- worse -- patch vLLM so that a worker fails much later.
Here each plugin's registration runs guarded: a plugin that raises is reported
by name (entry point, distribution, version, the exception) and skipped.

It is an error instead when the user asked for the plugin (it is named in
``VLLM_PLUGINS``) or set ``VLLM_PLUGINS_STRICT=1``: then start-up fails with
the same message.

Every process loads the plugins, so a failure would be printed by the API
server, the engine core and each worker. The first process to report it marks
it in ``VLLM_PLUGIN_FAILURES_REPORTED``, which the processes it starts inherit;
they log it at debug level only. Workers other than rank 0 stay quiet too.
"""

import hashlib
import os
from dataclasses import dataclass
from importlib.metadata import entry_points

from vllm.logger import init_logger

logger = init_logger(__name__)

STRICT_ENV = "VLLM_PLUGINS_STRICT"
REPORTED_ENV = "VLLM_PLUGIN_FAILURES_REPORTED"


class PluginError(RuntimeError):
    """A plugin the user requires failed."""


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    value: str
    dist: str
    version: str

    def describe(self) -> str:
        return (
            f"general plugin '{self.name}' ({self.value}) from "
            f"{self.dist} {self.version}"
        )

    def how_to_disable(self) -> str:
        others = sorted(
            ep.name for ep in entry_points(group=self.group) if ep.name != self.name
        )
        keep = ",".join(others)
        return (
            f"To run without it, uninstall it (pip uninstall {self.dist}) or set "
            f"VLLM_PLUGINS={keep!s} to load only the other plugins (VLLM_PLUGINS also "
            "filters platform plugins: list any you rely on)."
        )


def plugin_info(group: str, name: str) -> PluginInfo:
    for ep in entry_points(group=group, name=name):
        dist = getattr(ep, "dist", None)
        return PluginInfo(
            group,
            name,
            ep.value,
            dist.metadata["Name"] if dist else "an unknown distribution",
            dist.version if dist else "",
        )
    return PluginInfo(group, name, "?", "an unknown distribution", "")


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes")


def required(name: str) -> bool:
    """The user asked for this plugin, or for every plugin to work."""
    from vllm import envs

    return strict() or (envs.VLLM_PLUGINS is not None and name in envs.VLLM_PLUGINS)


def report_once(message: str, key: str) -> None:
    """Warn once across this process and the processes it starts."""
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    seen = os.environ.get(REPORTED_ENV, "").split(",")
    if digest in seen or _is_secondary_rank():
        logger.debug("%s", message)
        return
    logger.warning("%s", message)
    os.environ[REPORTED_ENV] = ",".join([s for s in seen if s] + [digest])


def _is_secondary_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def report_load_failure(group: str, name: str, error: Exception) -> None:
    """A plugin's entry point could not even be imported."""
    info = plugin_info(group, name)
    message = (
        f"{info.describe()} failed to load: {type(error).__name__}: {error}. "
        f"{info.how_to_disable()}"
    )
    if group == "vllm.general_plugins" and required(name):
        raise PluginError(message) from error
    logger.debug("Traceback of the plugin %s that failed to load", name, exc_info=error)
    report_once(
        message + " Skipped it.", key=f"load:{name}:{type(error).__name__}:{error}"
    )
