"""Test tooling for hybridkv: run vLLM 0.20.2's CPU-runnable unit tests and ours
on a machine without a GPU.

- ``cpu_platform``: a ``vllm.platform_plugins`` entry point that selects vLLM's
  CpuPlatform (``cpu_test_platform.CpuTestPlatform``, which adds what vLLM's
  GPU-runner tests ask of a device), but only when ``HYBRIDKV_TEST_PLATFORM=cpu``
  is set.
- ``pytest_plugin``: load with ``-p hybridkv.testing.pytest_plugin``.
"""
