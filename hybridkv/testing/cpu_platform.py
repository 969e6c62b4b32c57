"""vLLM platform plugin (entry-point group ``vllm.platform_plugins``) for CPU test runs.

vLLM 0.20.2 calls every plugin of that group when ``current_platform`` is first
resolved (vllm/platforms/__init__.py: resolve_current_platform_cls_qualname).
A plugin that returns ``None`` is simply not activated, and exceptions are
swallowed, so having this installed changes nothing unless the opt-in variable
is set: a real GPU deployment keeps its built-in CUDA platform.

With ``HYBRIDKV_TEST_PLATFORM=cpu`` it wins over the built-in plugins (an
activated out-of-tree plugin takes precedence), which turns vLLM's
``UnspecifiedPlatform`` on a GPU-less box (CUDA wheel of vLLM, CPU torch) into
``CpuPlatform`` (its subclass ``cpu_test_platform.CpuTestPlatform``). That fixes
"Failed to infer device type" and the teardown
``torch.accelerator.empty_cache()`` errors in vLLM's tests/conftest.py.

Keep this module import-free: vLLM imports it while resolving the platform.
"""

import os

ENV_VAR = "HYBRIDKV_TEST_PLATFORM"
CPU_PLATFORM = "hybridkv.testing.cpu_test_platform.CpuTestPlatform"


def cpu_platform_plugin() -> str | None:
    if os.environ.get(ENV_VAR, "").strip().lower() == "cpu":
        return CPU_PLATFORM
    return None
