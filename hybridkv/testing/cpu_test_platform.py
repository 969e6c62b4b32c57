"""The platform ``HYBRIDKV_TEST_PLATFORM=cpu`` selects: vLLM's CpuPlatform, plus
the device facts vLLM's GPU-runner tests ask of any device that a CPU can answer.

Imported by vLLM when it resolves ``current_platform`` (the entry point in
``cpu_platform`` names this class), never before.
"""

import os

from vllm.platforms.cpu import CpuPlatform


class CpuTestPlatform(CpuPlatform):
    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        # GPUModelRunner reads the compute-unit count when it is built (NVIDIA
        # SMs); CpuPlatform leaves it unimplemented, so vLLM's runner tests
        # (tests/v1/worker/test_gpu_model_runner.py) could not build one.
        return os.cpu_count() or 1
