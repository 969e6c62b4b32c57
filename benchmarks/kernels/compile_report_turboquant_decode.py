# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Registers, spills and shared memory of the split-KV TurboQuant decode kernel.

Compiles stage 1 of vllm/v1/attention/ops/triton_turboquant_decode_splitkv.py
for a GPU architecture without a GPU (Triton's compiler plus its bundled
``ptxas -v``), per preset, head_dim and launch geometry, and prints how many
programs fit on one SM and the PTX instructions of the tile loop per token
(warp instructions: an SM issues ~4 per clock, so this bounds tokens/s).
A cheap first filter for launch geometries before the microbenchmark
measures them:

    CUDA_VISIBLE_DEVICES= \\
    python benchmarks/kernels/compile_report_turboquant_decode.py \\
        [--arch 90] [--head-dims 128 256] [--geometries 16,2 32,4,64,168] [--byte-loads]

(about 5 s per compile on one core). ``--gluon`` reports the Gluon stage 1
(vllm/v1/attention/ops/gluon_turboquant_decode.py) for the presets it serves:
16 tokens per step, head_dim / 128 warps; it adds the SASS instructions of
the tile loop per token (``nvdisasm``, shipped with Triton, on the cubin),
and ``--sass`` prints that loop's opcode mix (memory, shuffle and barrier
opcodes first: the ones that queue on L1 and shared memory).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a file, only the script's own folder is on sys.path; imported as
# benchmarks.kernels.compile_report_turboquant_decode, it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turboquant_layer_setup import (  # noqa: E402
    add_presets_argument,
    codes_pairs,
)

GQA = {64: 4, 128: 4, 256: 6, 512: 8}
# KV heads of the benchmarks' model shapes (Qwen3-4B, Qwen3.6-27B, Gemma 4's
# full layers): the Gluon stage 1 compiles the cache's token stride in, and
# one KV head's stride gave another kernel (3bit_nc at head_dim 256: 186
# registers against 203-205 at run time; release 19, benchmarks/NOTES.md).
KV_HEADS = {64: 8, 128: 8, 256: 4, 512: 4}
SHARED_PER_SM = 228 * 1024


def _tile_loop(lines: list[str], label: str, branch: str) -> tuple[int, int] | None:
    """(label line, branch line) of the longest loop in an assembly listing,
    the tile loop, or None without one. ``label`` matches a label line and
    ``branch`` finds a branch's target, each as group 1."""
    heads: dict[str, int] = {}
    loop = None
    for i, line in enumerate(lines):
        if m := re.match(label, line):
            heads[m.group(1)] = i
        elif (m := re.search(branch, line)) and m.group(1) in heads:
            head = heads[m.group(1)]  # defined above: a backward branch
            if loop is None or i - head > loop[1] - loop[0]:
                loop = (head, i)
    return loop


def loop_instructions(ptx: str) -> int:
    """PTX instructions in the longest loop (the tile loop), per thread."""
    lines = [line.strip() for line in ptx.splitlines()]
    loop = _tile_loop(lines, r"(\$L__\w+):", r"bra(?:\.uni)?\s+(\$L__\w+);")
    start, end = loop or (0, 0)
    skip = ("$", "//", "{", "}", ".")
    return sum(1 for line in lines[start:end] if line and not line.startswith(skip))


# Opcodes that queue on the L1 / shared-memory pipe (or wait on it), listed
# first in the --sass mix.
MEMORY_OPCODES = ("LDG", "LDS", "LDSM", "STS", "STSM", "LDL", "STL", "SHFL", "BAR")


def _triton_tool(name: str) -> str:
    """A CUDA tool that Triton's NVIDIA backend ships (ptxas, nvdisasm)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no {name} at {path}: this report uses the one Triton's NVIDIA "
            "backend ships; install a triton wheel that has it"
        )
    return path


def sass_loop_opcodes(cubin: bytes) -> tuple[collections.Counter, int]:
    """Opcode counts (per thread, predicated or not) of the longest loop in
    the cubin's SASS, the tile loop, and how many of them sit in conditional
    blocks (``BSSY`` .. ``BSYNC``: the softmax rescale, which most tiles
    skip)."""
    nvdisasm = _triton_tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [nvdisasm, "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    lines = sass.splitlines()
    loop = _tile_loop(lines, r"\s*(\.L_x_\d+):", r"BRA\s+(?:`\()?(\.L_x_\d+)")
    if loop is None:
        raise ValueError("the SASS has no backward branch: no tile loop to count")
    ops = collections.Counter()
    depth = conditional = 0
    for line in lines[loop[0] : loop[1] + 1]:
        if inst := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            op = re.sub(r"^@!?U?P\w+\s+", "", inst.group(1))  # drop the predicate
            op = op.split()[0].split(".")[0]
            ops[op] += 1
            depth -= op == "BSYNC"
            conditional += depth > 0
            depth += op == "BSSY"
    return ops, conditional


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    # The register bound is the Gluon stage 1's model (per scheduler, not per
    # SM): at 226 registers ncu's "Block Limit Registers" reads 8 one-warp
    # programs, not 9; at 172 and 180, 4 two-warp programs, not 5.
    from vllm.v1.attention.ops.gluon_turboquant_decode import resident_warps

    return min(resident_warps(registers) // warps, SHARED_PER_SM // max(shared, 1))


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) as ``ptxas -v`` reports."""
    ptxas = _triton_tool("ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        info = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return registers, spills


def compile_stage1(
    preset, head_dim, group, geometry, arch, query_dtype="bf16", word16=True
):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as splitkv
    from vllm.v1.attention.ops.turboquant_decode import MIN_SPLIT_TOKENS
    from vllm.v1.attention.ops.turboquant_slot_layout import config_slot_layout

    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    fn = splitkv._tq_decode_split_stage1
    block_n, num_warps, key_chunk, maxnreg = (tuple(geometry) + (64, 0))[:4]
    num_stages = 1
    pointers = dict(
        Q_ptr=f"*{query_dtype}" if cfg.key_fp8 else "*fp32",
        KV8_ptr="*u8",
        KV16_ptr="*i16" if word16 else "*u8",
        Block_table_ptr="*i32",
        Seq_lens_ptr="*i32",
        Centroids_ptr="*fp32",
        Out_ptr=f"*{query_dtype}",
        Mid_ptr="*fp32",
        qk_scale="fp32",
    )
    constants = splitkv.stage1_constexprs(
        config_slot_layout(cfg),
        16,
        group,
        (block_n, num_warps, key_chunk, maxnreg),
        True,
        MIN_SPLIT_TOKENS,
        cfg.norm_correction,
        0,
        word16,
        pair_code=codes_pairs(cfg),
    )
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constants),
        target=GPUTarget("cuda", arch, 32),
        options=dict(
            num_warps=num_warps,
            num_stages=num_stages,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        ),
    )
    registers, spills = _ptxas_usage(kernel.asm["ptx"], arch)
    loop = loop_instructions(kernel.asm["ptx"])
    shared = kernel.metadata.shared
    per_sm = programs_per_sm(registers, num_warps, shared)
    return registers, spills, shared, per_sm, loop * num_warps / block_n


def gluon_static_compile():
    """The tests' compile of the Gluon stage 1 without a GPU
    (tests/kernels/attention/gluon_static_compile.py), from this checkout:
    run as a file, only the script's own folder is on sys.path."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.kernels.attention import gluon_static_compile

    return gluon_static_compile


def compile_gluon_stage1(preset, head_dim, group, arch):
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
        fp16_centroids,
    )
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon_decode

    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    if not gluon_decode.serves(
        head_dim, group, 16, cfg.key_fp8, cfg.key_mse_bits, cfg.value_quant_bits
    ):
        raise ValueError("not served by the Gluon stage 1")
    tails = False
    pairs = codes_pairs(cfg)
    if not cfg.key_fp8 and not pairs:  # a layer's centroids decide the tails' dot
        centroids = fp16_centroids(head_dim, cfg.key_mse_bits)
        gluon_decode.key_table(centroids)
        tails = gluon_decode.key_tails(centroids)
    kernel = gluon_static_compile().static_compile(
        head_dim,
        group,
        cfg.key_fp8,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.norm_correction,
        cfg.slot_size_aligned * KV_HEADS[head_dim],
        arch,
        value_bits=cfg.value_quant_bits,
        key_tails=tails,
        pairs=pairs,
    )
    registers, spills = _ptxas_usage(kernel.asm["ptx"], arch)
    shared = kernel.metadata.shared
    warps = kernel.metadata.num_warps
    per_sm = programs_per_sm(registers, warps, shared)
    loop = loop_instructions(kernel.asm["ptx"])
    sass, conditional = sass_loop_opcodes(kernel.asm["cubin"])
    return (
        registers, spills, shared, per_sm, loop * warps / gluon_decode.TILE, sass,
        conditional,
    )  # fmt: skip


def geometry_arg(text: str) -> tuple[int, ...]:
    """``--geometries``' BLOCK_N,warps[,key_chunk[,maxnreg]]."""
    try:
        geometry = tuple(int(x) for x in text.split(","))
    except ValueError:
        geometry = ()
    if not 2 <= len(geometry) <= 4 or min(geometry[:2]) < 1 or min(geometry) < 0:
        raise argparse.ArgumentTypeError(
            f"invalid geometry {text!r}: expected BLOCK_N,warps[,key_chunk[,maxnreg]], "
            "2 to 4 whole numbers (tokens per tile and warps at least 1), e.g. "
            "32,4 or 16,2,64,168"
        )
    return geometry


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    add_presets_argument(ap)
    ap.add_argument(
        "--head-dims", nargs="+", type=int, default=[128, 256, 512], choices=sorted(GQA)
    )
    ap.add_argument(
        "--geometries",
        nargs="+",
        type=geometry_arg,
        default=None,
        help="BLOCK_N,warps[,key_chunk[,maxnreg]] ... (default: the kernel's own)",
    )
    ap.add_argument(
        "--byte-loads",
        action="store_true",
        help="the odd-stride path (pages padded to an odd size)",
    )
    ap.add_argument("--gluon", action="store_true", help="the Gluon stage 1")
    ap.add_argument(
        "--sass",
        action="store_true",
        help="with --gluon: the tile loop's SASS opcode mix per 16-token tile",
    )
    args = ap.parse_args()
    if args.sass and not args.gluon:
        ap.error("--sass reports the Gluon stage 1: add --gluon")
    if args.gluon:
        print(
            "preset                  head_dim  regs  spill  shared  progs/SM  "
            "loop warp-instr/token (PTX, SASS)"
        )
        for preset in args.presets:
            for head_dim in args.head_dims:
                try:
                    regs, spills, shared, per_sm, per_token, sass, cond = (
                        compile_gluon_stage1(preset, head_dim, GQA[head_dim], args.arch)
                    )
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{preset:23s} {head_dim:8d}: {e}")
                    continue
                # Each warp runs the loop over one 16-token tile.
                sass_per_token = sum(sass.values()) * head_dim // 128 / 16
                print(
                    f"{preset:23s} {head_dim:8d} {regs:5d} {spills:6d} "
                    f"{shared // 1024:5d}K {per_sm:9d} {per_token:10.0f} "
                    f"{sass_per_token:6.0f}",
                    flush=True,
                )
                if args.sass:
                    first = [(op, sass[op]) for op in MEMORY_OPCODES if sass[op]]
                    rest = [
                        (op, n)
                        for op, n in sass.most_common()
                        if op not in MEMORY_OPCODES
                    ]
                    mix = ", ".join(f"{op} {n}" for op, n in first + rest)
                    print(
                        f"  SASS per warp and tile ({sum(sass.values())}, of them "
                        f"{cond} in conditional blocks): {mix}"
                    )
        return
    from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as splitkv

    print(
        "preset                  head_dim geometry         regs  spill  shared  "
        "progs/SM  loop warp-instr/token"
    )
    for preset in args.presets:
        for head_dim in args.head_dims:
            geometries = args.geometries or [
                splitkv.default_geometry(head_dim, preset == "turboquant_k8v4")
            ]
            for geometry in geometries:
                try:
                    regs, spills, shared, per_sm, per_token = compile_stage1(
                        preset,
                        head_dim,
                        GQA[head_dim],
                        geometry,
                        args.arch,
                        word16=not args.byte_loads,
                    )
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{preset:23s} {head_dim:8d} {geometry}: {e}")
                    continue
                print(
                    f"{preset:23s} {head_dim:8d} {str(geometry):16s} {regs:5d} "
                    f"{spills:6d} {shared // 1024:5d}K {per_sm:9d} {per_token:10.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
