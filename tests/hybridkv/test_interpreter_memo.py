# SPDX-License-Identifier: Apache-2.0
"""hybridkv.testing.interpreter_memo: interpreter launches that recur exactly
are read back, and anything a launch can read that changed runs it again.

Each case runs in a child process (``interpreter_child``).
"""

import textwrap

from tests.hybridkv.interpreter_child import run_interpreted

# The device function and the constant it reads live in a module of their own:
# what a kernel's globals reach is part of its code.
OPS = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    SHIFT = tl.constexpr(1.0)


    @triton.jit
    def shifted(x):
        return x + SHIFT
    """
)

KERNEL = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    from kern_ops import shifted


    @triton.jit
    def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, shifted(x * 2.0), mask=mask)
    """
)

CHILD = textwrap.dedent(
    """
    import json, sys

    import torch
    import triton.language as tl

    from hybridkv.testing import interpreter_memo as memo

    installed = memo.install(sys.argv[1])
    import kern
    import kern_ops

    def run(x, out):
        before = dict(memo.stats)
        kern.kernel[(2,)](x, out, x.numel(), BLOCK=16)
        return memo.stats["reused"] - before["reused"], out.tolist()

    x = torch.linspace(-1, 1, 20)
    steps = {}
    steps["first"] = run(x, torch.full_like(x, float("nan")))
    steps["same"] = run(x, torch.full_like(x, float("nan")))
    # An output from torch.empty, in memory just freed with other bytes in it:
    # the memo fills fresh allocations, so it keys as the NaN-filled one.
    junk = torch.randn(20)
    del junk
    steps["empty"] = run(x, torch.empty(20))
    y = x.clone()
    y[7] = 5.0
    steps["input"] = run(y, torch.full_like(x, float("nan")))
    # A test that wraps the interpreter's loads to count them sees the launch run.
    from triton.runtime.interpreter import InterpreterBuilder

    plain_load = InterpreterBuilder.create_masked_load
    loads = []

    def counting_load(self, *args, **kwargs):
        loads.append(1)
        return plain_load(self, *args, **kwargs)

    InterpreterBuilder.create_masked_load = counting_load
    steps["watched"] = run(x, torch.full_like(x, float("nan")))
    InterpreterBuilder.create_masked_load = plain_load
    kern_ops.SHIFT = tl.constexpr(2.0)
    steps["constant"] = run(x, torch.full_like(x, float("nan")))
    kern_ops.SHIFT = tl.constexpr(1.0)
    # Both arguments in one storage: the whole storage comes back.
    shared = torch.cat([x, torch.zeros(20)])
    steps["shared"] = run(shared[:20], shared[20:])
    shared = torch.cat([x, torch.zeros(20)])
    reused, _ = run(shared[:20], shared[20:])
    steps["shared_again"] = (reused, shared.tolist())
    # A launch read back runs no torch op: a dispatch mode that records writes
    # (the output-rows tests') sees it as it sees a launch run.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    out = torch.full_like(x, float("nan"))
    before = memo.stats["reused"]
    with Ops() as mode:
        kern.kernel[(2,)](x, out, x.numel(), BLOCK=16)
    steps["quiet"] = (memo.stats["reused"] - before, mode.ops)
    print(json.dumps(
        {"installed": installed, "steps": steps, "x": x.tolist(), "loads": len(loads)}
    ))
    """
)


def _child(tmp_path, memo_dir) -> dict:
    (tmp_path / "child.py").write_text(CHILD)
    if not (tmp_path / "kern_ops.py").exists():
        (tmp_path / "kern_ops.py").write_text(OPS)
    return run_interpreted(tmp_path / "child.py", str(memo_dir), path=[tmp_path])


def _want(x, scale=2.0, shift=1.0):
    return [v * scale + shift for v in x]


def _close(a, b):
    return all(abs(p - q) < 1e-6 for p, q in zip(a, b, strict=True))


def test_a_launch_that_recurs_exactly_is_read_back_and_any_change_runs_it(tmp_path):
    (tmp_path / "kern.py").write_text(KERNEL)
    memo = tmp_path / "memo"
    got = _child(tmp_path, memo)
    steps, x = got["steps"], got["x"]
    assert got["installed"]
    assert steps["first"][0] == 0 and _close(steps["first"][1], _want(x))
    assert steps["same"] == [1, steps["first"][1]]
    assert steps["empty"] == [1, steps["first"][1]]
    assert steps["watched"] == [0, steps["first"][1]] and got["loads"] > 0
    changed = list(x)
    changed[7] = 5.0
    assert steps["input"][0] == 0 and _close(steps["input"][1], _want(changed))
    assert steps["constant"][0] == 0
    assert _close(steps["constant"][1], _want(x, shift=2.0))
    assert steps["shared"][0] == 0 and _close(steps["shared"][1], _want(x))
    reused, shared = steps["shared_again"]
    assert reused == 1 and _close(shared, x + _want(x))
    assert steps["quiet"] == [1, []]

    # Another process with the same folder reads every launch back.
    again = _child(tmp_path, memo)["steps"]
    assert {k: v[0] for k, v in again.items()} == {
        **dict.fromkeys(steps, 1),
        "watched": 0,
    }
    assert {k: v[1] for k, v in again.items()} == {k: v[1] for k, v in steps.items()}


def test_a_changed_kernel_or_a_cut_file_runs_again(tmp_path):
    (tmp_path / "kern.py").write_text(KERNEL)
    memo = tmp_path / "memo"
    _child(tmp_path, memo)
    (tmp_path / "kern.py").write_text(KERNEL.replace("x * 2.0", "x * 3.0"))
    edited = _child(tmp_path, memo)
    assert edited["steps"]["first"][0] == 0
    assert _close(edited["steps"]["first"][1], _want(edited["x"], scale=3.0))
    (tmp_path / "kern_ops.py").write_text(OPS.replace("x + SHIFT", "x + SHIFT + 1.0"))
    edited = _child(tmp_path, memo)
    assert edited["steps"]["first"][0] == 0
    assert _close(edited["steps"]["first"][1], _want(edited["x"], 3.0, 2.0))

    for kept in memo.iterdir():
        kept.write_bytes(kept.read_bytes()[:-1])
    cut = _child(tmp_path, memo)
    assert cut["steps"]["first"][0] == 0
    assert _close(cut["steps"]["first"][1], _want(cut["x"], 3.0, 2.0))
