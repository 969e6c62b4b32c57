# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launch a JIT-compiled Triton or Gluon kernel again without the JIT's
per-launch bookkeeping.

``kernel[grid](*args, **kwargs)`` binds and specializes every argument, then
turns the specialization and every keyword argument into a string and looks
it up, re-checks the kernel's globals and builds launch metadata for hooks.
For a kernel with a few dozen constexprs (Gluon layouts among them) that is
most of a launch's host time: 47-80 µs against 10-17 µs for the launch
itself on an H100 host. Steps that no full CUDA graph covers (prefill chunks
beside decode rows, batches above the largest graph, eager engines) pay it
for every launch of every layer.

``CompiledLaunch(kernel)[grid](*args, **kwargs)`` launches what
``kernel[grid](*args, **kwargs)`` would. Triton stays the only compiler and
the only judge of specialization: the kernel's own argument binder
specializes a launch's arguments, and the compiled kernel of a (device,
keyword arguments, specialization of the positional arguments) seen before
is launched directly; anything new goes through ``kernel[grid]``, whose
compiled kernel is kept. A launch whose positional arguments match one the
binder has judged (``_args_key``: each tensor's dtype and address mod 16,
every other argument's type and value) skips the binder too: that key is
finer than any specialization Triton makes (a tensor's dtype and 16-byte
alignment; an int's width, its divisibility by 16 and whether it is 1; a
float's, bool's or None's type), so the binder would find the same kernel.
The binder is the larger part of a direct launch's host time: 8 of ~13 µs
for the TurboQuant Gluon stage 1's 21 arguments and 38 constexprs on a CPU
host. ``launch(grid, *args, variant=key, **kwargs)`` takes a hashable
``key`` that determines every keyword argument, for callers whose keyword
values are costly to hash (``ByIdentity`` for a mapping built once per
configuration); ``launch_with(grid, args, options, key)`` takes such a
mapping as it is, so a launch seen before does not copy its few dozen
entries into keyword arguments (2.3 of ~5 µs of the TurboQuant Gluon stage
1's keyed launch on a CPU host). ``launcher(kernel)`` is the one ``CompiledLaunch`` of a
kernel object, looked up at the launch so that a kernel replaced on its
module (tests, benchmarks) is the one launched.

The JIT's own path is taken where a launch hook is installed (profilers see
every launch), for a callable grid, and with ``VLLM_TRITON_COMPILED_LAUNCH=0``
(``vllm/envs.py``; A/B runs). Without Triton there is nothing to launch and
every call goes to the kernel object, as vLLM's placeholders expect.

``recorded_launches()`` lists the direct launches made inside it, and
``LaunchPlan.build`` turns such a list into launches sent again with other
tensors bound to some arguments: no argument is bound, keyed or judged
again, each compiled kernel's ``run`` is called as a direct launch calls
it. A caller that makes the same launches for a given key of its inputs
(``turboquant_decode``) keeps one plan per key.
"""

import contextlib
import contextvars
from collections.abc import Hashable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

import vllm.envs as envs

try:
    from triton import knobs
    from triton.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:
    JITFunction = None


class ByIdentity:
    """A key that is one object, not its value: for a mapping of constexprs
    built once per configuration and kept (``functools.cache``), whose
    values (Gluon layouts) are slower to hash than the launch saves. The key
    holds the object, so its identity is not reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, ByIdentity) and other.obj is self.obj


class RecordedLaunch(NamedTuple):
    """One direct launch as ``recorded_launches`` saw it."""

    compiled: Any
    grid: tuple[int, int, int]
    args: tuple
    rest: tuple


# The list recorded_launches() appends to; a launch through the JIT appends
# None (a plan cannot send it again directly).
_record: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "compiled_launch_record", default=None
)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[RecordedLaunch | None]]:
    """The launches made inside, in order: a ``RecordedLaunch`` for each
    compiled kernel launched by ``CompiledLaunch``, None for each launch
    that went through the JIT's own path (hooks, a callable grid, switched
    off, an asynchronous compile)."""
    records: list[RecordedLaunch | None] = []
    token = _record.set(records)
    try:
        yield records
    finally:
        _record.reset(token)


def hooks_installed() -> bool:
    """Whether a launch hook would have to see each launch (profilers)."""
    return bool(
        knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
    )


class CompiledLaunch:
    """A JIT kernel whose repeated launches skip the JIT's bookkeeping."""

    # Launch keys kept per kernel (``_args_key``): past this many the map
    # starts again, so arguments that never repeat cannot grow it.
    MAX_ARGS_KEYS = 1024

    def __init__(self, kernel, enabled: bool | None = None):
        self.kernel = kernel
        enabled = envs.VLLM_TRITON_COMPILED_LAUNCH if enabled is None else enabled
        self.enabled = (
            enabled and JITFunction is not None and isinstance(kernel, JITFunction)
        )
        # Positional arguments must be the kernel's leading runtime
        # parameters: the key below reads their specialization only.
        self._constexpr = [p.is_constexpr for p in getattr(kernel, "params", ())]
        self._compiled: dict[Hashable, object] = {}
        # _args_key -> (compiled kernel, the parameters after the positional
        # ones, as the binder fills them in).
        self._by_args: dict[Hashable, tuple[object, tuple]] = {}
        self.direct = 0  # launches that skipped the JIT (tests, benchmarks)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)

    def _jit_only(self, grid, num_args: int) -> bool:
        return (
            not self.enabled
            or callable(grid)
            or bool(knobs.runtime.launch_enter_hook.calls)
            or bool(knobs.runtime.launch_exit_hook.calls)
            or num_args > len(self._constexpr)
            or any(self._constexpr[:num_args])
        )

    @staticmethod
    def _args_key(args: tuple) -> Hashable:
        """Positional arguments as far as a compiled kernel depends on them,
        finer than Triton's specialization (see the module's docstring)."""
        return tuple(map(type, args)), tuple(
            [(a.dtype, a.data_ptr() & 15) if isinstance(a, Tensor) else a for a in args]
        )

    def launch(self, grid, *args, variant: Hashable = None, **kwargs):
        return self.launch_with(grid, args, kwargs, variant)

    def launch_with(
        self,
        grid,
        args: tuple,
        options: Mapping[str, Any],
        variant: Hashable = None,
    ):
        """``launch(grid, *args, variant=variant, **options)``, reading
        ``options`` only for a launch not seen before."""
        kernel = self.kernel
        records = _record.get()
        if self._jit_only(grid, len(args)):
            if records is not None:
                records.append(None)
            return kernel[grid](*args, **options)
        device = driver.active.get_current_device()
        # The JIT adds these before binding; the binder sees the same.
        debug = options.get("debug", kernel.debug) or knobs.runtime.debug
        mode = knobs.compilation.instrumentation_mode
        if variant is None:
            variant = tuple(options.items())
        try:
            key = (device, variant, debug, mode, self._args_key(args))
            hit = self._by_args.get(key)
        except TypeError:  # an argument that cannot be hashed: bind each time
            key = hit = None
        if hit is None:
            kwargs = dict(options)
            kwargs["debug"] = debug
            kwargs["instrumentation_mode"] = mode
            binder = kernel.device_caches[device][4]
            bound, specialization, _ = binder(*args, **kwargs)
            judged = (device, variant, debug, mode, tuple(specialization[: len(args)]))
            compiled = self._compiled.get(judged)
            launched = compiled is None
            if launched:
                compiled = kernel[grid](*args, **kwargs)
                # Only a finished compile (not a future of an asynchronous one).
                if not isinstance(compiled, CompiledKernel):
                    if records is not None:
                        records.append(None)
                    return compiled
                self._compiled[judged] = compiled
            hit = (compiled, tuple(bound.values())[len(args) :])
            if key is not None:
                if len(self._by_args) >= self.MAX_ARGS_KEYS:
                    self._by_args.clear()
                self._by_args[key] = hit
            if launched:
                if records is not None:
                    grid = (*grid, 1, 1)
                    records.append(RecordedLaunch(compiled, grid[:3], args, hit[1]))
                return compiled
        compiled, rest = hit
        grid = (*grid, 1, 1)
        if records is not None:
            records.append(RecordedLaunch(compiled, grid[:3], args, rest))
        compiled.run(
            grid[0],
            grid[1],
            grid[2],
            driver.active.get_current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: only hooks read it, and none is installed
            None,
            None,
            *args,
            *rest,
        )
        self.direct += 1
        return compiled


_launchers: dict[ByIdentity, CompiledLaunch] = {}


def launcher(kernel) -> CompiledLaunch:
    """The ``CompiledLaunch`` of ``kernel`` (one per kernel object)."""
    key = ByIdentity(kernel)
    hit = _launchers.get(key)
    if hit is None:
        hit = _launchers[key] = CompiledLaunch(kernel)
    return hit


class LaunchPlan:
    """Recorded launches (``recorded_launches``), sent again with other
    tensors in some of their arguments.

    ``build`` sorts every tensor argument of the recorded launches into one
    of four kinds; one that fits none, or more than one, makes no plan:

    - ``bound`` (the same address and dtype): the tensor passed to
      ``launch`` in its place;
    - ``fresh`` (the same address and dtype): a tensor of its size, strides
      and dtype that each ``launch`` allocates, for what a launch of the
      plan writes and a later one reads;
    - at the address of one of ``fixed``: that address, as an int. The plan
      keeps none of these tensors alive, so its owner keys it by their
      addresses (a tensor at the same address is then the one it was built
      for);
    - one of ``kept`` (the same object): itself, kept alive by the plan.

    Anything a call computes other than by its recorded launches (a copy, a
    matmul) is therefore not in the plan: its output is a tensor of none of
    these kinds, and the caller gets no plan for that call.
    """

    __slots__ = ("device", "torch_device", "fresh", "launches")

    @classmethod
    def build(
        cls,
        records: list[RecordedLaunch | None],
        bound: tuple[Tensor | None, ...],
        fresh: tuple[Tensor, ...] = (),
        fixed: tuple[Tensor | None, ...] = (),
        kept: tuple[Tensor | None, ...] = (),
    ) -> "LaunchPlan | None":
        if not records or any(r is None for r in records):
            return None
        slots: dict[tuple, int] = {}
        for i, t in enumerate((*bound, *fresh)):
            if t is not None:
                key = (t.data_ptr(), t.dtype)
                slots[key] = -1 if key in slots else i
        addresses = {t.data_ptr() for t in fixed if t is not None}
        kept_ids = {id(t) for t in kept if t is not None}
        launches = []
        for compiled, grid, args, rest in records:
            template = list(args)
            binds = []
            for i, a in enumerate(args):
                if not isinstance(a, Tensor):
                    continue
                slot = slots.get((a.data_ptr(), a.dtype))
                kinds = (
                    (slot is not None)
                    + (a.data_ptr() in addresses)
                    + (id(a) in kept_ids)
                )
                if kinds != 1 or slot == -1:
                    return None
                if slot is not None:
                    binds.append((i, slot))
                    template[i] = None
                elif id(a) not in kept_ids:
                    template[i] = a.data_ptr()
            launches.append((compiled, grid, tuple(template), tuple(binds), rest))
        plan = cls()
        plan.device = driver.active.get_current_device()
        device = next(t.device for t in (*bound, *fresh) if t is not None)
        plan.torch_device = device
        plan.fresh = tuple((t.shape, t.stride(), t.dtype) for t in fresh)
        plan.launches = tuple(launches)
        return plan

    def launch(self, *tensors: Tensor | None) -> tuple[Tensor | None, ...] | None:
        """Send the launches with ``tensors`` in ``bound``'s places. Returns
        those tensors then the fresh ones, or None, having launched nothing,
        where a direct launch is not allowed now (a launch hook installed,
        another device current)."""
        if hooks_installed():
            return None
        device = driver.active.get_current_device()
        if device != self.device:
            return None
        sources = tensors + tuple(
            torch.empty_strided(size, stride, dtype=dtype, device=self.torch_device)
            for size, stride, dtype in self.fresh
        )
        stream = driver.active.get_current_stream(device)
        for compiled, grid, args, binds, rest in self.launches:
            if binds:
                args = list(args)
                for i, slot in binds:
                    args[i] = sources[slot]
            compiled.run(
                *grid,
                stream,
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
                *rest,
            )
        return sources
