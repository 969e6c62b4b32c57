# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Notice when a general plugin replaces a vLLM core hook; name it when that fails.

Out-of-tree plugins monkey-patch vLLM internals (the KV-cache spec of attention
layers, backend selection, the spec-to-manager registry). When vLLM moves on,
such a patch fails far from the plugin -- e.g. ``TypeError:
TQ4FullAttentionSpec.__init__() got an unexpected keyword argument
'tq_slot_size'`` from a worker -- with nothing pointing at the plugin.

Each watched hook is snapshotted before a plugin registers and compared after.
A replaced function is wrapped so that a ``TypeError``/``AttributeError`` out
of it (the signature of API drift) names the plugin and how to disable it.

Falling back to vLLM's own hook after such an error is allowed only when it
cannot mix two layouts: the user did not ask for the plugin (``VLLM_PLUGINS``),
strict mode is off, and the attention backend in use is not one the plugin
registered. Results the plugin's hook already returned are not kept: the
caller that collects them (``GPUModelRunner.get_kv_cache_spec``, decorated
with :func:`retry_without_failed_plugins`) starts over with vLLM's hook. vLLM
then gets exactly what its own backends expect, as if the plugin were absent.
Otherwise the error is raised, with the same text.
"""

import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.plugins.isolation import (
    STRICT_ENV,
    PluginError,
    PluginInfo,
    plugin_info,
    report_once,
    required,
)

logger = init_logger(__name__)

# (module, class or None, attribute): the hooks plugins are known to replace.
WATCHED_HOOKS: list[tuple[str, str | None, str]] = [
    (
        "vllm.model_executor.layers.attention.attention",
        "Attention",
        "get_kv_cache_spec",
    ),
    ("vllm.v1.attention.selector", None, "get_attn_backend"),
    ("vllm.v1.attention.selector", None, "_cached_get_attn_backend"),
    ("vllm.v1.kv_cache_interface", None, "FullAttentionSpec"),
    ("vllm.v1.kv_cache_interface", None, "SlidingWindowSpec"),
    ("vllm.v1.kv_cache_interface", None, "MambaSpec"),
    ("vllm.v1.kv_cache_interface", None, "TQFullAttentionSpec"),
]
# (module, dict attribute): registries plugins add entries to.
WATCHED_REGISTRIES: list[tuple[str, str]] = [
    ("vllm.v1.core.single_type_kv_cache_manager", "spec_manager_map"),
    ("vllm.v1.attention.backends.registry", "_ATTN_OVERRIDES"),
]


class PluginHookError(PluginError):
    """A core hook replaced by a plugin failed, and falling back is not safe."""


class PluginHookFallback(PluginError):
    """A replaced hook failed after earlier calls had returned the plugin's results.

    Those results must not be mixed with vLLM's own: the caller that collects
    them (decorated with :func:`retry_without_failed_plugins`) starts over, now
    with vLLM's hook. Anywhere else this is an error naming the plugin.
    """


def retry_without_failed_plugins(collect: Callable) -> Callable:
    """Recompute a batch of hook results if a plugin's hook was dropped half-way."""

    @functools.wraps(collect)
    def wrapper(*args, **kwargs):
        try:
            return collect(*args, **kwargs)
        except PluginHookFallback:
            return collect(*args, **kwargs)

    return wrapper


def _hook_name(module: str, cls: str | None, attr: str) -> str:
    return ".".join(p for p in (module, cls, attr) if p)


@dataclass
class _Hook:
    name: str
    owner: Any
    attr: str

    def raw(self) -> Any:
        # The class/module __dict__ entry: identity survives for methods and
        # classmethods, unlike getattr's bound objects.
        return vars(self.owner).get(self.attr)


@dataclass
class HookWatch:
    hooks: list[_Hook] = field(default_factory=list)
    registries: dict[str, dict] = field(default_factory=dict)
    # Attention backends each plugin registered, by plugin name.
    plugin_backends: dict[str, set] = field(default_factory=dict)

    @classmethod
    def start(cls) -> "HookWatch":
        watch = cls()
        for module, owner_name, attr in WATCHED_HOOKS:
            try:
                mod = importlib.import_module(module)
            except Exception:  # a platform without this module has no such hook
                continue
            owner = getattr(mod, owner_name) if owner_name else mod
            if attr in vars(owner):
                watch.hooks.append(
                    _Hook(_hook_name(module, owner_name, attr), owner, attr)
                )
        for module, attr in WATCHED_REGISTRIES:
            mod = sys.modules.get(module) or importlib.import_module(module)
            watch.registries[_hook_name(module, None, attr)] = getattr(mod, attr)
        return watch

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {h.name: h.raw() for h in self.hooks}
        snap.update({n: dict(r) for n, r in self.registries.items()})
        return snap

    def restore(self, before: dict[str, Any]) -> None:
        """Undo what a plugin that failed half-way had already replaced."""
        for h in self.hooks:
            if h.raw() is not before[h.name]:
                setattr(h.owner, h.attr, before[h.name])
        for name, registry in self.registries.items():
            registry.clear()
            registry.update(before[name])

    def after_plugin(self, info: PluginInfo, before: dict[str, Any]) -> None:
        for h in self.hooks:
            new = h.raw()
            if new is before[h.name]:
                continue
            report_once(
                f"{info.describe()} replaced vLLM core hook {h.name}. If vLLM fails "
                f"inside it, the error will name the plugin. {info.how_to_disable()}",
                key=f"replaced:{h.name}:{info.name}",
            )
            if _is_plain_function(new) and _is_plain_function(before[h.name]):
                setattr(h.owner, h.attr, self._guard(info, h, new, before[h.name]))
        for name, registry in self.registries.items():
            added = [k for k in registry if k not in before[name]]
            changed = [
                k
                for k in before[name]
                if k in registry and registry[k] != before[name][k]
            ]
            if added or changed:
                report_once(
                    f"{info.describe()} changed vLLM registry {name}: "
                    + ", ".join(str(k) for k in added + changed),
                    key=f"registry:{name}:{info.name}",
                )
            if name.endswith("_ATTN_OVERRIDES"):
                self.plugin_backends.setdefault(info.name, set()).update(
                    added + changed
                )

    def _guard(
        self, info: PluginInfo, hook: _Hook, new: Callable, original: Callable
    ) -> Callable:
        watch = self

        succeeded = False

        @functools.wraps(new)
        def guarded(*args, **kwargs):
            nonlocal succeeded
            try:
                result = new(*args, **kwargs)
                succeeded = True
                return result
            except (TypeError, AttributeError) as e:
                message = (
                    f"vLLM core hook {hook.name} was replaced by {info.describe()}, "
                    f"and it raised {type(e).__name__}: {e}. The plugin was probably "
                    "written for another vLLM version "
                    f"(this is vLLM {_vllm_version()}). {info.how_to_disable()}"
                )
                unsafe = watch._fallback_unsafe(info)
                if required(info.name) or unsafe:
                    raise PluginHookError(
                        message + (f" ({unsafe})" if unsafe else "")
                    ) from e
                report_once(
                    message + " Falling back to vLLM's own hook: the plugin's hook "
                    "produced nothing, and the attention backend in use is not the "
                    "plugin's.",
                    key=f"hook:{hook.name}:{info.name}:{type(e).__name__}",
                )
                # Later calls go straight to vLLM's hook: one report, no retries.
                setattr(hook.owner, hook.attr, original)
                if succeeded:
                    raise PluginHookFallback(message) from e
                return original(*args, **kwargs)

        guarded.__hybridkv_guarded__ = True  # type: ignore[attr-defined]
        return guarded

    def _fallback_unsafe(self, info: PluginInfo) -> str | None:
        backends = self.plugin_backends.get(info.name)
        if not backends:
            return None
        from vllm.config import get_current_vllm_config

        selected = get_current_vllm_config().attention_config.backend
        if selected in backends:
            return (
                f"the selected attention backend {selected} is registered by this "
                "plugin, so vLLM's own KV layout would not match it"
            )
        return None


def _is_plain_function(obj: Any) -> bool:
    return callable(obj) and not isinstance(obj, (type, staticmethod, classmethod))


def _vllm_version() -> str:
    from vllm import __version__

    return __version__


def run_general_plugins(group: str, plugins: dict[str, Callable[[], Any]]) -> None:
    """Call each plugin's registration function; report and skip the ones that fail."""
    infos = {name: plugin_info(group, name) for name in plugins}
    # Only third-party plugins are watched: vLLM's own need no snapshot, and
    # taking one imports the attention modules.
    watch = HookWatch.start() if any(i.dist != "vllm" for i in infos.values()) else None
    for name, func in plugins.items():
        info = infos[name]
        before = watch.snapshot() if watch else None
        try:
            func()
        except Exception as e:
            if watch:
                watch.restore(before)
            message = (
                f"{info.describe()} failed to register: {type(e).__name__}: {e}. "
                f"{info.how_to_disable()}"
            )
            if required(name):
                raise PluginError(
                    message
                    + f" Not skipped: it is named in VLLM_PLUGINS or {STRICT_ENV}=1."
                ) from e
            logger.debug("Traceback of the failed plugin %s", name, exc_info=True)
            report_once(
                message + " Skipped it.", key=f"register:{name}:{type(e).__name__}:{e}"
            )
            continue
        if watch:
            watch.after_plugin(info, before)
