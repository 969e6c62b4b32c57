# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a Gluon kernel's body on NumPy: its logic, without a GPU.

Gluon has no CPU interpreter. Its tensor operations (reshape, permute, join,
split, reductions, loads through pointer tensors) are defined on logical
tensors, whatever their layouts, so running the kernel's Python body with
NumPy arrays checks every index permutation, table and softmax step. Layouts,
layout conversions and barriers are no-ops here; inline-asm helpers and
``mma_v2`` are replaced by NumPy models (``MODELS``), which is what this
cannot check, with the hardware itself. Unmasked out-of-bounds loads and
stores raise.

Only the operations the TurboQuant decode kernel uses are provided. Module
constants the kernel reads (``gl.constexpr``) are passed as their values.
"""

import types

import numpy as np
import torch
from triton.language import constexpr


class Tensor(np.ndarray):
    """A NumPy array with the few Gluon tensor methods the kernel calls."""

    def to(self, dtype, bitcast=False):
        if dtype is FLOAT8E4NV:
            return _E4M3[np.asarray(self).astype(np.int64) & 0xFF].view(Tensor)
        if bitcast:
            return np.asarray(self).view(dtype.np).view(Tensor)
        return np.asarray(self).astype(dtype.np).view(Tensor)


def _t(x) -> Tensor:
    return np.asarray(x).view(Tensor)


class _DType:
    def __init__(self, np_dtype):
        self.np = np_dtype


float16, float32 = _DType(np.float16), _DType(np.float32)
int16, int32, int64 = _DType(np.int16), _DType(np.int32), _DType(np.int64)
uint8, uint16, uint32 = _DType(np.uint8), _DType(np.uint16), _DType(np.uint32)
FLOAT8E4NV = _DType(None)
_E4M3 = (
    torch.arange(256, dtype=torch.int32)
    .to(torch.uint8)
    .view(torch.float8_e4m3fn)
    .float()
    .numpy()
)
_BY_TORCH = {
    torch.float32: float32,
    torch.float16: float16,
    torch.int32: int32,
    torch.int16: int16,
}


class Pointer:
    """A pointer tensor: a flat typed buffer and element offsets into it."""

    def __init__(self, buf: np.ndarray, off, element_ty):
        self.buf, self.off = buf, np.asarray(off, dtype=np.int64)
        self.dtype = types.SimpleNamespace(element_ty=element_ty)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Pointer":
        """A pointer to ``tensor``'s first element, sharing its memory."""
        flat = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())
        return cls(flat.numpy(), tensor.storage_offset(), _BY_TORCH.get(tensor.dtype))

    def __add__(self, x):
        return Pointer(
            self.buf, self.off + np.asarray(x, dtype=np.int64), self.dtype.element_ty
        )

    __radd__ = __add__

    def __getitem__(self, idx):
        return Pointer(self.buf, self.off[idx], self.dtype.element_ty)


def _masked(ptr, mask, shape=()):
    shape = np.broadcast_shapes(
        ptr.off.shape, np.shape(mask) if mask is not None else (), shape
    )
    off = np.broadcast_to(ptr.off, shape)
    m = (
        np.ones(shape, bool)
        if mask is None
        else np.broadcast_to(np.asarray(mask), shape)
    )
    if (m & ((off < 0) | (off >= ptr.buf.size))).any():
        raise IndexError("unmasked access outside the buffer")
    return off, m


def _load(ptr, mask=None, other=0):
    off, m = _masked(ptr, mask)
    vals = ptr.buf[np.where(m, off, 0)]
    return _t(np.where(m, vals, np.asarray(other).astype(ptr.buf.dtype)))


def _store(ptr, val, mask=None):
    off, m = _masked(ptr, mask, np.shape(val))
    val = np.broadcast_to(np.asarray(val), off.shape)
    ptr.buf[off[m]] = val[m].astype(ptr.buf.dtype)


class _Shared:
    def __init__(self, array: np.ndarray):
        self.a = array

    def store(self, x):
        if x.shape != self.a.shape:
            raise ValueError(f"store of {x.shape} into shared {self.a.shape}")
        self.a[...] = np.asarray(x).astype(self.a.dtype)

    def load(self, layout):
        return _t(self.a.copy())

    def index(self, i):
        return _Shared(self.a[i])

    def slice(self, start, length, dim=0):
        idx = [slice(None)] * self.a.ndim
        idx[dim] = slice(start, start + length)
        return _Shared(self.a[tuple(idx)])

    def _reinterpret(self, dtype, shape, layout):
        return _Shared(self.a.view(dtype.np).reshape(shape))


def _none(*args, **kwargs):
    return None


def _language(pid) -> types.SimpleNamespace:
    gl = types.SimpleNamespace(
        float16=float16,
        float32=float32,
        int16=int16,
        int32=int32,
        int64=int64,
        uint8=uint8,
        uint16=uint16,
        uint32=uint32,
        float8e4nv=FLOAT8E4NV,
        constexpr=object,
        program_id=lambda i: _t(np.int32(pid[i])),
        arange=lambda a, b, layout=None: _t(np.arange(a, b, dtype=np.int32)),
        full=lambda shape, value, dtype, layout=None: _t(
            np.full(shape, value, dtype.np)
        ),
        where=lambda c, a, b: _t(np.where(c, a, b)),
        maximum=lambda a, b: _t(np.maximum(a, b)),
        minimum=lambda a, b: _t(np.minimum(a, b)),
        exp2=lambda x: _t(np.exp2(x)),
        log2=lambda x: _t(np.log2(x)),
        sqrt=lambda x: _t(np.sqrt(x)),
        sum=lambda x, axis: _t(np.sum(x, axis=axis, dtype=np.asarray(x).dtype)),
        max=lambda x, axis: _t(np.max(x, axis=axis)),
        reshape=lambda x, shape: _t(np.reshape(np.asarray(x), shape)),
        permute=lambda x, dims: _t(np.ascontiguousarray(np.transpose(x, dims))),
        join=lambda a, b: _t(np.stack(np.broadcast_arrays(a, b), -1)),
        split=lambda x: (_t(np.asarray(x)[..., 0]), _t(np.asarray(x)[..., 1])),
        expand_dims=lambda x, axis: _t(np.expand_dims(np.asarray(x), axis)),
        convert_layout=lambda x, layout, assert_trivial=False: x,
        cdiv=lambda a, b: (a + b - 1) // b,
        static_range=range,
        thread_barrier=_none,
        allocate_shared_memory=lambda dtype, shape, layout: _Shared(
            np.zeros(shape, dtype.np)
        ),
        load=_load,
        store=_store,
        SliceLayout=_none,
        BlockedLayout=_none,
    )
    return gl


def _e4m3x4(w):
    w = np.asarray(w).astype(np.int64)
    return tuple(_t(_E4M3[(w >> (8 * i)) & 0xFF].astype(np.float16)) for i in range(4))


def _u4x8(w):
    w = np.asarray(w).astype(np.int64)
    return tuple(_t(((w >> (4 * i)) & 15).astype(np.float16)) for i in range(8))


def _f16x2(w):
    w = np.asarray(w).astype(np.int64) & 0xFFFFFFFF
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (w >> 16).astype(np.uint16).view(np.float16)
    return _t(lo), _t(hi)


def _mma_v2(a, b, acc, input_precision=None):
    # fp16 products are exact in fp32; the hardware accumulates in fp32.
    r = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return _t((np.asarray(acc, np.float64) + r).astype(np.float32))


MODELS = {
    "_e4m3x4_to_f16": _e4m3x4,
    "_u4x8_to_f16": _u4x8,
    "_f16x2": _f16x2,
    "mma_v2": _mma_v2,
}


def runner(models=None):
    """A ``runner(kernel, grid, args, constexprs)`` executing on NumPy."""
    models = {**MODELS, **(models or {})}

    def run(kernel, grid, args, constexprs):
        fn = kernel.fn
        ptr_args = [Pointer.of(a) if torch.is_tensor(a) else a for a in args]
        for s in range(grid[0]):
            for h in range(grid[1]):
                for r in range(grid[2]):
                    glb = {
                        name: getattr(obj, "value", obj)
                        if isinstance(obj, constexpr)
                        else obj
                        for name, obj in fn.__globals__.items()
                    }
                    glb["gl"] = _language((s, h, r))
                    for name, obj in list(glb.items()):
                        body = getattr(obj, "fn", None)
                        if name not in models and hasattr(body, "__code__"):
                            glb[name] = types.FunctionType(body.__code__, glb, name)
                    glb.update(models)
                    types.FunctionType(fn.__code__, glb, fn.__name__)(
                        *ptr_args, **constexprs
                    )

    return run
