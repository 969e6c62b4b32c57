# SPDX-License-Identifier: Apache-2.0
"""Triton's CPU interpreter, with triton.language patched once per launch.

Triton 3.6's interpreter patches ``triton.language`` for the interpreter
(``_patch_lang``: an ``inspect.getmembers`` walk over ``tl``, ``tl.core``,
``tl.math`` and the tensor class, a new wrapper per builtin) when a kernel
launch starts, and restores it when the launch ends. It walks again at every
call of a ``@triton.jit`` device function, inside a launch that has already
patched the same modules with the same builtins. A kernel that calls device
functions in each of its programs walks thousands of times a launch: without
them the kernel tests (tests/kernels) run in three quarters of the time.

``install()`` makes a device function's call skip the walk when the launch it
runs in has already patched every language module the function sees; any other
call walks as before. A skipped walk would have set what is already set, so the
kernels compute the same values.
"""

import inspect

# Marks the interpreter functions this module has wrapped.
_WRAPPED = "_hybridkv_patch_once"


def install() -> bool:
    """Wrap the interpreter's language patch; False where this Triton has no
    such interpreter (nothing changed then)."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    executor = getattr(itp, "GridExecutor", None)
    patch_lang = getattr(itp, "_patch_lang", None)
    scope_type = getattr(itp, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, _WRAPPED, False):
        return True
    lang_modules = (itp.tl, itp.tl.core)
    launch_call = executor.__call__
    # Language modules patched by each launch in progress, innermost last.
    launches: list[set[int]] = []
    seen_by: dict[object, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        langs = seen_by.get(fn)
        if langs is None:
            langs = frozenset(
                id(value)
                for value in fn.__globals__.values()
                if inspect.ismodule(value) and value in lang_modules
            )
            seen_by[fn] = langs
        return langs

    def patch_once(fn):
        langs = langs_of(fn)
        if launches and langs <= launches[-1]:
            return scope_type()
        scope = patch_lang(fn)
        if launches:
            launches[-1].update(langs)
        return scope

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            launches.pop()

    setattr(patch_once, _WRAPPED, True)
    itp._patch_lang = patch_once
    executor.__call__ = launch
    return True
