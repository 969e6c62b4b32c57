# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host benchmark's cache-update breakdown captures the store's one launch
(benchmarks/kernels/benchmark_turboquant_host.py). Here because the store's
arguments need Triton: under the CPU interpreter, or on a GPU."""

import pytest
import torch

from tests.benchmarks import import_benchmark


@pytest.fixture
def bench():
    return import_benchmark("benchmarks.kernels.benchmark_turboquant_host")


@pytest.mark.parametrize(
    "preset, kernel",
    [
        ("turboquant_4bit_nc", "_tq_store_mse_hadamard"),
        ("turboquant_k8v4", "_tq_store_fp8_strided"),
    ],
)
def test_the_store_breakdown_captures_the_one_launch_and_can_skip_it(
    bench, preset, kernel, triton_device
):
    """The cache update's "by part" table times the backend's Python with the
    store's launch captured and not run, then that launch alone: the capture
    holds the kernel the backend launches, its grid, and nothing was stored."""
    cam, num_pages = bench._step_metadata(3, 40, 0, 0, torch.device(triton_device))
    impl, layer, cache = bench._tq_layer(preset, num_pages, torch.device(triton_device))
    k = torch.randn(3, bench.HK, bench.D, dtype=torch.bfloat16, device=triton_device)

    def update():
        impl.do_kv_cache_update(layer, k, k, cache, cam.slot_mapping)

    got = bench.captured_store_launch(update, run=False)
    assert got["kernel"].fn.__name__ == kernel
    assert got["grid"] == (3 * bench.HK,)
    assert not cache.any()
    md = bench.markdown("H100", [], None, {preset: dict(update=111.0, binder=9.5)})
    assert f"| {preset} | 111.0 | 9.5 |" in md


def test_launches_skipped_launches_nothing_and_then_launches_again(
    bench, triton_device
):
    """The forward's "by part" table times the backend with every launch
    through ``CompiledLaunch`` skipped: inside, the cache update stores
    nothing; after it, the same update stores."""
    cam, num_pages = bench._step_metadata(3, 40, 0, 0, torch.device(triton_device))
    impl, layer, cache = bench._tq_layer(
        "turboquant_4bit_nc", num_pages, torch.device(triton_device)
    )
    k = torch.randn(3, bench.HK, bench.D, dtype=torch.bfloat16, device=triton_device)
    with bench.launches_skipped():
        impl.do_kv_cache_update(layer, k, k, cache, cam.slot_mapping)
    assert not cache.any()
    impl.do_kv_cache_update(layer, k, k, cache, cam.slot_mapping)
    assert cache.any()
    md = bench.markdown(
        "H100",
        [],
        None,
        None,
        {"turboquant_4bit_nc": dict(forward=180.0, launches=60.0)},
    )
    assert "| turboquant_4bit_nc | 180.0 | 60.0 |" in md
