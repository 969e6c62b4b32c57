"""Test tooling for hybridkv: run vLLM 0.20.2's CPU-runnable unit tests and ours
on a machine without a GPU.

- ``cpu_platform``: a ``vllm.platform_plugins`` entry point that selects vLLM's
  CpuPlatform, but only when ``HYBRIDKV_TEST_PLATFORM=cpu`` is set.
- ``pytest_plugin``: load with ``-p hybridkv.testing.pytest_plugin``.
"""
