# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The store microbenchmark (benchmarks/kernels/benchmark_turboquant_store.py)
without a GPU: the store it times as served, and its report."""

from tests.benchmarks import import_benchmark


def _bench():
    return import_benchmark("benchmarks.kernels.benchmark_turboquant_store")


def _timer(fn):
    fn()
    return 1.0


def test_the_store_is_also_timed_as_the_backend_calls_it(monkeypatch):
    # The backend stores 3- and 4-bit MSE keys with a key offset (0027) and
    # rotated values (0028); this benchmark timed only the plain call, the
    # store no served layer runs (benchmarks/NOTES.md, "Store": at head_dim
    # 512 and 8K tokens the served store read 1.33-1.50x bf16 where the
    # plain call read 1.05-1.28x).
    bench = _bench()
    monkeypatch.setattr(bench, "graphed", lambda fn: fn)
    seen = []
    cfg = bench.tq_config("turboquant_4bit_nc", 128)
    timed = bench.time_served(
        _timer, lambda **extras: seen.append(extras), cfg, 32, 8, 128, 64, "cpu"
    )
    assert timed == dict(served_eager=1.0, served_graph=1.0)
    assert len(seen) == 2
    assert seen[0].keys() == {"key_offset", "positions", "value_rotation"}
    assert seen[0]["positions"].tolist() == list(range(64))
    # FP8 keys take neither: the plain call is the served one.
    cfg = bench.tq_config("turboquant_k8v4", 128)
    timed = bench.time_served(_timer, seen.append, cfg, 32, 8, 128, 64, "cpu")
    assert timed == dict(served_same_call=True)


def test_the_report_puts_the_store_as_served_against_bf16():
    bench = _bench()
    meta = dict(
        time="2026-12-03 07:30 UTC",
        device="NVIDIA H200",
        torch="2.11.0+cu130",
        triton="3.6.0",
        vllm="0.20.2+hybridkv.72",
        copy_bandwidth_gbs=4257.0,
    )
    row = dict(shape="Qwen3-4B 8x128", tokens=64, floor_us=0.1, bf16_eager=20.0)
    rows = [
        dict(row, kv="4bit_nc", bytes=6.6e5, old_eager=120.0, new_eager=22.0,
             served_eager=23.0, old_graph=30.0, new_graph=5.5, served_graph=5.0,
             bf16_graph=5.0),
        dict(row, kv="k8v4", bytes=7.2e5, old_eager=25.0, new_eager=21.0,
             old_graph=6.0, new_graph=4.9, served_same_call=True, bf16_graph=5.0),
    ]  # fmt: skip
    md = bench.markdown(meta, rows)
    assert (
        "| graph as served | graph bf16 | new/bf16 graph | as served/bf16 graph |" in md
    )
    assert "| 22.0 | 23.0 | 20.0 | 30.0 | 5.5 | 5.0 | 5.0 | 1.10x | 1.00x |" in md
    assert "| 21.0 | 21.0 | 20.0 | 6.0 | 4.9 | 4.9 | 5.0 | 0.98x | 0.98x |" in md
    assert "new    22.0 served    23.0 bf16   20.0" in bench.fmt(rows[0])
