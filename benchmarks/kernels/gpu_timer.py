# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU time of one call as the kernel benchmarks take it: CUDA events
around it, L2 flushed before it, its launch hidden behind a GPU sleep, and
the device's copy bandwidth that their percentages divide by."""

import functools
import statistics
import time

import torch


def launched_in_time(gpu_us, host_us, sleep_us: float) -> list[float]:
    """The GPU times of the samples whose launch (``host_us``, from the start
    event to the call's return) ended within the sleep queued ahead of them
    (``sleep_us``). In a later one the GPU waited for the host inside the
    timed interval, which then measured the launch, not the kernels."""
    return [g for g, h in zip(gpu_us, host_us) if h < sleep_us]


class Timer:
    """GPU time of a call: CUDA events around it, L2 flushed before it, and
    the GPU kept busy while the host launches it, so a slow Python launch
    path does not show up as kernel time (decode steps replay CUDA graphs).
    The host's launch time is kept apart (``host_us``); samples launched
    after the sleep ended are dropped (``late``)."""

    # ~1 ms of GPU sleep ahead of each timed call. The decode's launch path
    # took 120-610 us (release 19's table), so a burst of slow launches could
    # outlast it: single medians of 632-1,180 us were read where the kernels
    # took 58-136 us, once in ~50 readings (release 19; benchmarks/NOTES.md,
    # "Measurement pitfalls"); whether late launches caused them was not checked.
    SLEEP_CYCLES = 2_000_000

    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup
        # Larger than H100/H200 L2 (50/60 MB): every timed call starts cold.
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        self.host_us: float | None = None
        self.late = 0
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(self.SLEEP_CYCLES)  # clocks up before the reading
        start.record()
        torch.cuda._sleep(self.SLEEP_CYCLES)
        end.record()
        torch.cuda.synchronize()
        self.sleep_us = start.elapsed_time(end) * 1e3

    def __call__(self, fn) -> float:
        """Median microseconds of fn() on the GPU over the samples launched
        in time (all of them, and ``late`` says so, if none was); median host
        launch time of fn() in ``self.host_us``."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        host = []
        for s, e in zip(starts, ends):
            torch.cuda._sleep(self.SLEEP_CYCLES)
            self.flush.zero_()
            s.record()
            t = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t) * 1e6)
            e.record()
            torch.cuda.synchronize()
        self.host_us = statistics.median(host)
        gpu = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        kept = launched_in_time(gpu, host, self.sleep_us)
        self.late = len(gpu) - len(kept)
        if self.late:
            print(
                f"  timer: {self.late} of {len(gpu)} samples launched after the "
                f"{self.sleep_us:.0f} us sleep ended (host up to {max(host):.0f} "
                f"us); {'dropped' if kept else 'kept: none was in time'}",
                flush=True,
            )
        return statistics.median(kept or gpu)


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy, (read + write) bytes per second."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = timer(functools.partial(dst.copy_, src))
    return 2 * n / (t * 1e-6)
