# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a Gluon kernel's body on NumPy: its logic, without a GPU.

Gluon has no CPU interpreter. Its tensor operations (reshape, permute, join,
split, reductions, loads through pointer tensors) are defined on logical
tensors, whatever their layouts, so running the kernel's Python body with
NumPy arrays checks every index permutation, table and softmax step. Layouts,
layout conversions and barriers are no-ops here. ``mma_v2`` and some
inline-asm helpers are replaced by NumPy models (``MODELS``); the other
helpers' asm runs on ``ptx``, an emulator of the few PTX integer (and f16x2)
instructions they use, so their text itself is checked. What this cannot
check is the hardware. Unmasked out-of-bounds loads and stores raise.

Only the operations the TurboQuant decode kernel uses are provided. Module
constants the kernel reads (``gl.constexpr``) are passed as their values.
"""

import re
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

    def to(self, ty):
        """A pointer of another element type to the same bytes (``ty`` from
        ``gl.pointer_type``); its address must be aligned to that type, as
        on a GPU."""
        ratio = np.dtype(ty.element_ty.np).itemsize // self.buf.itemsize
        if ratio < 1 or (self.off % ratio).any():
            raise ValueError(
                f"pointer cast to {ty.element_ty.np} at element {self.off} of "
                f"{self.buf.dtype}: not aligned to its size"
            )
        return Pointer(
            self.buf.view(ty.element_ty.np), self.off // ratio, ty.element_ty
        )


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


class _PointerType:
    def __init__(self, element_ty):
        self.element_ty = element_ty


class _Shared:
    def __init__(self, array: np.ndarray):
        self.a = array

    def permute(self, order):
        return _Shared(np.transpose(self.a, order))

    def store(self, x):
        if x.shape != self.a.shape:
            raise ValueError(f"store of {x.shape} into shared {self.a.shape}")
        self.a[...] = np.asarray(x).astype(self.a.dtype)

    def load(self, layout):
        return _t(self.a.copy())

    def index(self, i):
        # int(): a 0-d array index would copy (NumPy's advanced indexing)
        # where the kernel means a view of its buffer.
        return _Shared(self.a[int(i)])

    def slice(self, start, length, dim=0):
        idx = [slice(None)] * self.a.ndim
        idx[dim] = slice(start, start + length)
        return _Shared(self.a[tuple(idx)])

    def _reinterpret(self, dtype, shape, layout):
        return _Shared(self.a.view(dtype.np).reshape(shape))


def _none(*args, **kwargs):
    return None


def _language(pid, grid) -> types.SimpleNamespace:
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
        pointer_type=_PointerType,
        program_id=lambda i: _t(np.int32(pid[i])),
        num_programs=lambda i: _t(np.int32(grid[i])),
        arange=lambda a, b, layout=None: _t(np.arange(a, b, dtype=np.int32)),
        full=lambda shape, value, dtype, layout=None: _t(
            np.full(shape, value, dtype.np)
        ),
        where=lambda c, a, b: _t(np.where(c, a, b)),
        abs=lambda x: _t(np.abs(x)),
        maximum=lambda a, b: _t(np.maximum(a, b)),
        minimum=lambda a, b: _t(np.minimum(a, b)),
        exp2=lambda x: _t(np.exp2(x)),
        log2=lambda x: _t(np.log2(x)),
        sqrt=lambda x: _t(np.sqrt(x)),
        rsqrt=lambda x: _t((1 / np.sqrt(np.asarray(x, np.float64))).astype(np.float32)),
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
        inline_asm_elementwise=_inline_asm_elementwise,
    )
    return gl


_M32 = 0xFFFFFFFF


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _prmt(a, b, c):
    src = (a & _M32) | ((b & _M32) << 32)  # bytes 0-3 of a, 4-7 of b
    out = np.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = (src >> (8 * (sel & 7))) & 0xFF
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def _dp4a(a, b, c):
    return c + sum(((a >> (8 * i)) & 0xFF) * ((b >> (8 * i)) & 0xFF) for i in range(4))


def _f16x2(op):
    """An f16x2 instruction on the two fp16 halves of each operand, computed
    in float64 and rounded once (as ``fma.rn`` does; ``sub`` of fp16 values
    is exact in float64 too)."""

    def halves(x):
        lo = (x & 0xFFFF).astype(np.uint16).view(np.float16)
        hi = ((x >> 16) & 0xFFFF).astype(np.uint16).view(np.float16)
        return lo.astype(np.float64), hi.astype(np.float64)

    def run(*xs):
        parts = [halves(x) for x in xs]
        lo, hi = (op(*(p[i] for p in parts)).astype(np.float16) for i in (0, 1))
        return lo.view(np.uint16).astype(np.int64) | (
            hi.view(np.uint16).astype(np.int64) << 16
        )

    return run


_OPS = {
    "shr.b32": lambda a, b: (a & _M32) >> b,
    "shl.b32": lambda a, b: a << b,
    "and.b32": lambda a, b: a & b,
    "add.u32": lambda a, b: a + b,
    # (b:a) >> min(c, 32), the low 32 bits
    "shf.r.clamp.b32": lambda a, b, c: ((a & _M32) | ((b & _M32) << 32))
    >> np.minimum(c, 32),
    "mul.lo.u32": lambda a, b: a * b,
    "mad.lo.u32": lambda a, b, c: a * b + c,
    "lop3.b32": _lop3,
    "prmt.b32": _prmt,
    "dp4a.u32.u32": _dp4a,
    "sub.f16x2": _f16x2(lambda a, b: a - b),
    "fma.rn.f16x2": _f16x2(lambda a, b, c: a * b + c),
}


def ptx(asm: str, constraints: str, args, dtypes):
    """Run an inline-asm block on NumPy: ``$i`` are the outputs, then the
    inputs; registers are unsigned 32-bit (``=h`` outputs: 16-bit halves
    from ``mov.b32 {lo, hi}``). ``%laneid`` reads 31, the last lane, so an
    access by lane that is in bounds for lane 0 only raises."""
    cons = [c.strip() for c in constraints.split(",")]
    n_out = sum(c.startswith("=") for c in cons)
    args = np.broadcast_arrays(*[np.asarray(a).astype(np.int64) & _M32 for a in args])
    regs = {f"${n_out + i}": a for i, a in enumerate(args)}
    shape = args[0].shape if args else ()
    regs["%laneid"] = np.full(shape, 31, np.int64)

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0), np.int64)

    for stmt in asm.split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op in ("mov.b32", "mov.u32"):
            dst, src = re.fullmatch(r"(\{[^}]*\}|[^,]+),\s*(.+)", rest).groups()
            if dst.startswith("{"):  # unpack into 16-bit halves
                lo, hi = (t.strip() for t in dst.strip("{}").split(","))
                regs[lo], regs[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            else:
                regs[dst] = val(src) & _M32
            continue
        if op not in _OPS:
            raise NotImplementedError(f"ptx: no model of {op!r}")
        dst, *srcs = (t.strip() for t in rest.split(","))
        regs[dst] = _OPS[op](*(val(t) for t in srcs)) & _M32
    outs = []
    for i, (con, dt) in enumerate(zip(cons[:n_out], dtypes)):
        bits = regs[f"${i}"]
        if con == "=h":
            outs.append(_t(bits.astype(np.uint16).view(dt.np)))
        else:
            outs.append(_t(bits.astype(np.uint32).view(dt.np)))
    return outs


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    if pack != 1:
        raise NotImplementedError("ptx: pack=1 only")
    multi = isinstance(dtype, tuple)
    outs = ptx(asm, constraints, args, dtype if multi else (dtype,))
    return tuple(outs) if multi else outs[0]


def _values(globals_: dict) -> dict:
    """A kernel's globals with its ``gl.constexpr`` constants as their values."""
    return {
        name: obj.value if isinstance(obj, constexpr) else obj
        for name, obj in globals_.items()
    }


def call(helper, *args, rewrite=None):
    """Run a ``gluon.jit`` helper's body on NumPy (its asm on ``ptx``, after
    ``rewrite(asm)`` where given: faults injected into the text)."""
    glb = _values(helper.fn.__globals__)
    gl = _language((0, 0, 0), (1, 1, 1))
    if rewrite is not None:
        gl.inline_asm_elementwise = lambda asm, *a, **k: _inline_asm_elementwise(
            rewrite(asm), *a, **k
        )
    glb["gl"] = gl
    _unwrap_helpers(glb)
    return types.FunctionType(helper.fn.__code__, glb)(*args)


def _unwrap_helpers(glb: dict) -> None:
    """The ``gluon.jit`` helpers among a kernel's globals as plain Python
    functions of those globals, so that the helpers they call run too."""
    for name, obj in list(glb.items()):
        body = getattr(obj, "fn", None)
        if hasattr(body, "__code__"):
            glb[name] = types.FunctionType(body.__code__, glb, name)


def _e4m3x4(w):
    w = np.asarray(w).astype(np.int64)
    return tuple(_t(_E4M3[(w >> (8 * i)) & 0xFF].astype(np.float16)) for i in range(4))


def _mma_v2(a, b, acc, input_precision=None):
    # fp16 products are exact in fp32; the hardware accumulates in fp32.
    r = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return _t((np.asarray(acc, np.float64) + r).astype(np.float32))


MODELS = {
    "_e4m3x4_to_f16": _e4m3x4,
    "mma_v2": _mma_v2,
}


def runner(models=None):
    """A ``runner(kernel, grid, args, constexprs)`` executing on NumPy, one
    program at a time in the order a GPU hands blocks out: x fastest."""
    models = {**MODELS, **(models or {})}

    def run(kernel, grid, args, constexprs):
        fn = kernel.fn
        ptr_args = [Pointer.of(a) if torch.is_tensor(a) else a for a in args]
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    glb = _values(fn.__globals__)
                    glb["gl"] = _language((x, y, z), grid)
                    _unwrap_helpers(glb)
                    glb.update(models)
                    types.FunctionType(fn.__code__, glb, fn.__name__)(
                        *ptr_args, **constexprs
                    )

    return run
