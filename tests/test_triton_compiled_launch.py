# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``CompiledLaunch`` reuses a compiled kernel only for a launch the JIT
would send to that same kernel.

Runs without a GPU: the kernel is a real ``JITFunction`` with Triton's own
argument binder (the backend's ``specialize_impl`` judges every argument, as
in a launch); only the device side is a stand-in: the JIT's launch records
what it would compile and returns a compiled kernel whose ``run`` records
the arguments it would launch with.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import jit  # noqa: E402

from vllm.triton_utils import compiled_launch  # noqa: E402


def _copy(X, Y, n, stride, BLOCK: tl.constexpr):
    pass


class _Driver:
    """The two driver calls a launch makes."""

    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 1234


class _Active:
    active = _Driver()


class _Rig:
    def __init__(self, monkeypatch):
        kernel = jit.JITFunction(_copy)
        binder = jit.create_function_from_signature(
            kernel.signature, kernel.params, BaseBackend
        )
        self.binds = 0

        def counted_binder(*args, **kwargs):
            self.binds += 1
            return binder(*args, **kwargs)

        kernel.device_caches = {0: ({}, {}, None, BaseBackend, counted_binder)}
        self.compiles = []  # specialization of X, Y, n, stride per JIT launch
        self.launches = []  # arguments of each direct launch

        def jit_run(*args, grid, warmup, **kwargs):
            _, spec, _ = binder(*args, **kwargs)
            self.compiles.append(tuple(spec[:4]))
            compiled = CompiledKernel.__new__(CompiledKernel)
            compiled.function = "fn"
            compiled.packed_metadata = "meta"
            compiled.module = "module"  # handles loaded
            compiled._run = lambda *a: self.launches.append(a)
            return compiled

        monkeypatch.setattr(kernel, "run", jit_run)
        monkeypatch.setattr(compiled_launch, "driver", _Active)
        self.launcher = compiled_launch.CompiledLaunch(kernel, enabled=True)

    def __call__(self, x, y, n=100, stride=64, block=128):
        self.launcher[(3,)](x, y, n, stride, BLOCK=block, num_warps=4)


@pytest.fixture
def rig(monkeypatch):
    return _Rig(monkeypatch)


def test_a_repeated_launch_skips_the_jit(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    for _ in range(3):
        rig(x, y)
    assert len(rig.compiles) == 1
    assert rig.launcher.direct == 2
    first = rig.launches[0]
    assert first[:3] == (3, 1, 1)
    assert first[3:6] == (1234, "fn", "meta")
    assert first[6:9] == (None, None, None)  # no launch metadata, no hooks
    # Every parameter in order, the constexpr included, as the JIT passes them.
    assert first[9:] == (x, y, 100, 64, 128)


def test_arguments_seen_before_skip_the_binder(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    for _ in range(3):
        rig(x, y)
    # Once for the JIT's launch (which binds again), then not again.
    assert rig.binds == 1
    assert rig.launcher.direct == 2
    # Other tensors of the same dtype and alignment: the same key.
    rig(torch.zeros(256), torch.zeros(256))
    assert rig.binds == 1 and rig.launcher.direct == 3
    assert len(rig.compiles) == 1


def test_a_bool_where_an_int_was_is_judged_again(rig):
    """True == 1 and hash(True) == hash(1), but Triton passes a bool as u1
    and specializes an int 1 into the kernel: the key holds each type."""
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y, n=1)
    rig(x, y, n=True)
    assert len(rig.compiles) == 2 and rig.launcher.direct == 0


def test_the_launch_key_is_finer_than_tritons_specialization():
    """Two arguments with one key get one specialization from Triton's own
    rules (CUDA's and the base backend's), so a launch found by its key
    runs the kernel the binder would have chosen."""
    from triton._C.libtriton import native_specialize_impl

    backends = [BaseBackend]
    try:
        from triton.backends.nvidia.compiler import CUDABackend

        backends.append(CUDABackend)
    except ImportError:
        pass
    pool = []
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int32):
        t = torch.zeros(64, dtype=dtype)
        pool += [t[i:] for i in range(9)] + [torch.zeros(64, dtype=dtype)]
    pool += [0, 1, -1, 15, 16, 17, 32, 2**31 - 16, 2**31, 2**32, 2**63, 2**64 - 16]
    pool += [True, False, 1.0, 0.5, 16.0, None]
    for backend in backends:
        by_key = {}
        for arg in pool:
            for specialize in (True, False):
                key = (specialize, compiled_launch.CompiledLaunch._args_key((arg,)))
                spec = native_specialize_impl(backend, arg, False, specialize, True)
                assert by_key.setdefault(key, spec) == spec, (
                    f"{backend.__name__}: {arg!r} has the key of an argument "
                    f"Triton specializes as {by_key[key]}, but is {spec}"
                )


def test_keys_of_arguments_that_never_repeat_stay_bounded(rig, monkeypatch):
    monkeypatch.setattr(compiled_launch.CompiledLaunch, "MAX_ARGS_KEYS", 4)
    x, y = torch.zeros(256), torch.zeros(256)
    for n in range(5, 325, 16):  # 20 values, none a multiple of 16
        rig(x, y, n=n)
    assert len(rig.launcher._by_args) <= 4
    assert len(rig.compiles) == 1 and rig.launcher.direct == 19


@pytest.mark.parametrize(
    "change",
    [
        "pointer no longer 16-byte aligned",
        "int becomes 1",
        "int no longer a multiple of 16",
        "constexpr",
    ],
)
def test_what_the_jit_specializes_on_compiles_again(rig, change):
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)
    if change == "pointer no longer 16-byte aligned":
        rig(x[1:], y)
    elif change == "int becomes 1":
        rig(x, y, n=1)
    elif change == "int no longer a multiple of 16":
        rig(x, y, stride=65)
    else:
        rig(x, y, block=256)
    assert len(rig.compiles) == 2, f"{change}: reused a kernel compiled for another"
    assert rig.launcher.direct == 0
    if change != "constexpr":
        assert rig.compiles[0] != rig.compiles[1]


def test_a_value_the_jit_does_not_specialize_on_reuses(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y, n=100)
    rig(x[4:], y, n=37)  # 16 bytes further: aligned; 37 and 100 alike
    assert len(rig.compiles) == 1 and rig.launcher.direct == 1
    launched = rig.launches[0]
    assert launched[9].data_ptr() == x.data_ptr() + 16
    assert launched[10] is y and launched[11:13] == (37, 64)


def test_an_explicit_variant_keys_the_keyword_arguments(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    for block in (128, 256, 128):
        rig.launcher.launch((3,), x, y, 100, 64, variant=block, BLOCK=block)
    assert len(rig.compiles) == 2 and rig.launcher.direct == 1


class _CountedOptions(dict):
    """Keyword arguments that count how often they are copied whole."""

    copies = 0

    def keys(self):
        type(self).copies += 1
        return super().keys()

    def items(self):
        type(self).copies += 1
        return super().items()

    def __iter__(self):
        type(self).copies += 1
        return super().__iter__()


def test_options_as_one_mapping_are_copied_only_to_compile(rig, monkeypatch):
    """``launch_with`` launches what ``launch(**options)`` would, and a
    launch seen before leaves the mapping as it is: the Gluon stage 1 passes
    its few dozen constexprs that way (a copy into keyword arguments was 2.3
    of its ~5 µs keyed launch on a CPU host)."""
    monkeypatch.setattr(_CountedOptions, "copies", 0)
    x, y = torch.zeros(256), torch.zeros(256)
    options = _CountedOptions(BLOCK=128, num_warps=4)
    variant = object()
    for _ in range(3):
        rig.launcher.launch_with((3,), (x, y, 100, 64), options, variant)
    assert len(rig.compiles) == 1 and rig.launcher.direct == 2
    assert rig.launches[0][9:] == (x, y, 100, 64, 128)
    copies = _CountedOptions.copies
    assert copies > 0  # the first launch's binder and JIT
    rig.launcher.launch_with((3,), (x, y, 100, 64), options, variant)
    assert _CountedOptions.copies == copies
    # Keyed by the mapping's values instead, as ``launch`` keys its keywords.
    rig.launcher.launch_with((3,), (x, y, 100, 64), dict(BLOCK=256, num_warps=4))
    assert len(rig.compiles) == 2


def test_launch_hooks_see_every_launch(rig, monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)
    rig(x, y)
    assert len(rig.compiles) == 2 and rig.launcher.direct == 0


def test_switched_off_every_launch_goes_through_the_jit(rig):
    rig.launcher.enabled = False
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)
    rig(x, y)
    assert len(rig.compiles) == 2 and rig.launcher.direct == 0


def test_the_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_TRITON_COMPILED_LAUNCH", "0")
    assert not compiled_launch.CompiledLaunch(jit.JITFunction(_copy)).enabled
    monkeypatch.setenv("VLLM_TRITON_COMPILED_LAUNCH", "1")
    assert compiled_launch.CompiledLaunch(jit.JITFunction(_copy)).enabled


def test_a_kernel_that_is_no_jit_function_is_called_as_given():
    calls = []

    class Placeholder:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = compiled_launch.CompiledLaunch(Placeholder(), enabled=True)
    assert not launcher.enabled
    launcher[(2,)](1, B=3)
    assert calls == [((2,), (1,), {"B": 3})]


def test_each_kernel_object_has_one_launcher(monkeypatch):
    """A kernel replaced on its module (tests, benchmarks) gets its own."""
    monkeypatch.setattr(compiled_launch, "_launchers", {})
    kernel, replacement = jit.JITFunction(_copy), jit.JITFunction(_copy)
    first = compiled_launch.launcher(kernel)
    assert compiled_launch.launcher(kernel) is first
    assert first.kernel is kernel
    assert compiled_launch.launcher(replacement).kernel is replacement


def test_recorded_launches_are_sent_again_with_other_tensors(rig):
    """A plan sends what a direct launch sends, with the bound tensor of
    the call in its place and a fixed one by its address."""
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)  # compiled, and recorded like a direct launch
    with compiled_launch.recorded_launches() as records:
        rig(x, y)
    assert [r.args for r in records] == [(x, y, 100, 64)]
    plan = compiled_launch.LaunchPlan.build(records, bound=(x,), fixed=(y,))
    rig.launches.clear()
    x2 = torch.zeros(256)
    assert plan.launch(x2) == (x2,)
    (sent,) = rig.launches
    assert sent[:9] == (3, 1, 1, 1234, "fn", "meta", None, None, None)
    assert sent[9:] == (x2, y.data_ptr(), 100, 64, 128)
    assert rig.binds == 1  # the plan bound nothing


def test_a_plan_allocates_what_its_launches_write_for_each_other(rig):
    x = torch.zeros(256)
    rig(x, x)
    with compiled_launch.recorded_launches() as records:
        scratch = torch.empty(256)
        rig(x, scratch)
        rig(scratch, x)
    plan = compiled_launch.LaunchPlan.build(records, bound=(x,), fresh=(scratch,))
    rig.launches.clear()
    x2 = torch.zeros(256)
    _, new = plan.launch(x2)
    assert new.shape == scratch.shape and new.dtype == scratch.dtype
    assert new.data_ptr() not in (scratch.data_ptr(), x2.data_ptr())
    assert [sent[9:11] for sent in rig.launches] == [(x2, new), (new, x2)]


def test_a_tensor_a_plan_cannot_account_for_makes_no_plan(rig):
    """What a call computes outside its launches (here ``y``) is none of a
    plan's kinds: sending the launches again would read it stale."""
    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)
    with compiled_launch.recorded_launches() as records:
        rig(x, y)
    build = compiled_launch.LaunchPlan.build
    assert build(records, bound=(x,)) is None
    assert build(records, bound=(x,), kept=(y,)) is not None
    # One tensor of two kinds, or two sources at one address: no plan.
    assert build(records, bound=(x, y), fixed=(y,)) is None
    assert build(records, bound=(x, y), fresh=(y,)) is None
    # A view into the middle of a bound tensor is not that tensor.
    with compiled_launch.recorded_launches() as records:
        rig(x[64:], y)
    assert build(records, bound=(x,), fixed=(y,)) is None
    assert build([], bound=(x,)) is None


def test_a_launch_through_the_jit_makes_no_plan(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    rig.launcher.enabled = False
    with compiled_launch.recorded_launches() as records:
        rig(x, y)
    assert records == [None]
    assert compiled_launch.LaunchPlan.build(records, bound=(x, y)) is None


def test_a_plan_launches_nothing_while_a_hook_is_installed(rig, monkeypatch):
    from triton import knobs

    x, y = torch.zeros(256), torch.zeros(256)
    rig(x, y)
    with compiled_launch.recorded_launches() as records:
        rig(x, y)
    plan = compiled_launch.LaunchPlan.build(records, bound=(x, y))
    rig.launches.clear()
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])
    assert plan.launch(x, y) is None
    assert rig.launches == []


def test_launches_outside_a_recording_are_not_recorded(rig):
    x, y = torch.zeros(256), torch.zeros(256)
    with compiled_launch.recorded_launches() as records:
        rig(x, y)
    rig(x, y)
    assert len(records) == 1
