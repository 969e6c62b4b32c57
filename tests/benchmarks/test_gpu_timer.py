# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernel benchmarks' GPU timer (benchmarks/kernels/gpu_timer.py)
without a GPU: which samples it keeps."""

from tests.benchmarks import import_kernel_helper


def _timer():
    return import_kernel_helper("gpu_timer")


def test_timer_keeps_the_samples_launched_within_their_sleep():
    # A launch that outlasts the sleep ahead of it leaves the GPU idle inside
    # the timed interval: 1,136 us of "kernel" time where the kernels took 92.
    gpu = [100.0, 1136.0, 101.0, 99.0, 640.0]
    host = [400.0, 2100.0, 420.0, 390.0, 1010.0]
    assert _timer().launched_in_time(gpu, host, 1000.0) == [100.0, 101.0, 99.0]
    assert _timer().launched_in_time(gpu, host, 3000.0) == gpu
