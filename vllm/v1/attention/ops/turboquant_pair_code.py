# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant MSE keys coded by pairs of rotated coordinates.

The scalar code gives each rotated coordinate of a unit key the nearest of
2**bits levels. The pair code spends the same bits on two neighbouring
coordinates (2i, 2i + 1) at once: the nearest of 2**(2 * bits) points of the
plane. At 3 bits that is 64 points, and on pairs of independent Gaussian
coordinates (what the rotation makes a unit key's coordinates, nearly) the
mean squared error per coordinate falls from 0.0344 to 0.0297 of a
coordinate's variance. The slot does not change: a pair's 6-bit index ``n``
is written as two 3-bit fields, ``n % 8`` at coordinate 2i and ``n // 8`` at
2i + 1, so the key field, its norm and the value field lie where 3-bit keys
put them (``turboquant_slot_layout``).

A pair codebook is a [64, 2] float32 tensor, the points' two coordinates per
row; the store and the reads take it where they take the scalar levels, and
tell the two apart by its shape (``is_pair_codebook``). The points below were
fitted once by Lloyd's algorithm on 10**6 seeded pairs of N(0, 1)
coordinates, started from the 8 x 8 grid of the 3-bit Lloyd-Max levels;
``pair_codebook`` scales them to a head size's coordinates and rounds them to
fp16 values, as ``fp16_centroids`` rounds the scalar levels.

The store finds a pair's nearest point in a search table
(``pair_search_table``): the plane cut into 8 x 8 cells, each with the few
points that can be nearest to some pair inside it. A pair is compared with
its cell's candidates (7 for these points) instead of all 64, and the code
it gets is the one the search over all 64 gives.
"""

import functools
import math

import torch

from vllm.triton_utils import tl, triton

# Points of a pair code with 3 bits a coordinate, for N(0, 1) coordinates.
UNIT_PAIR_POINTS: tuple[tuple[float, float], ...] = (
    (-2.0828, -1.4794),
    (-1.6498, -0.7060),
    (-2.4527, -0.6055),
    (-1.7423, -0.0511),
    (-2.5390, 0.2897),
    (-1.7012, 0.5968),
    (-2.1903, 1.1016),
    (-2.0040, 1.8970),
    (-1.3987, -2.1246),
    (-1.2619, -1.2983),
    (-1.0713, -0.7274),
    (-1.1551, -0.2344),
    (-1.1692, 0.2664),
    (-1.1493, 0.7923),
    (-1.3189, 1.3663),
    (-1.1659, 2.2500),
    (-0.6013, -2.5158),
    (-0.6832, -1.6309),
    (-0.6604, -1.0001),
    (-0.6449, -0.4346),
    (-0.6819, 0.0486),
    (-0.6803, 0.5403),
    (-0.7038, 1.0953),
    (-0.6237, 1.7214),
    (-0.0607, -1.8625),
    (-0.2059, -1.2036),
    (-0.2277, -0.6627),
    (-0.2353, -0.1569),
    (-0.2497, 0.3097),
    (-0.2317, 0.8012),
    (-0.2028, 1.3029),
    (-0.2962, 2.5751),
    (0.3978, -2.6138),
    (0.2860, -1.3602),
    (0.2253, -0.8443),
    (0.1723, -0.3633),
    (0.1873, 0.1276),
    (0.1777, 0.5779),
    (0.2730, 1.1503),
    (0.1102, 1.8168),
    (0.6966, -1.7886),
    (0.7497, -1.0831),
    (0.6484, -0.5770),
    (0.5640, -0.1280),
    (0.7027, 0.2872),
    (0.5905, 0.7260),
    (0.8298, 1.1560),
    (0.7716, 1.6942),
    (1.3977, -2.2353),
    (1.2741, -1.3585),
    (1.1896, -0.6845),
    (1.0520, -0.2002),
    (1.2610, 0.2236),
    (1.1257, 0.7027),
    (1.4524, 1.2499),
    (0.6678, 2.5044),
    (2.1390, -1.5633),
    (1.7478, -0.8333),
    (2.5447, -0.6025),
    (1.7273, -0.1601),
    (2.5158, 0.2986),
    (1.7659, 0.5836),
    (2.3383, 1.2904),
    (1.5730, 2.0690),
)
PAIR_POINTS = len(UNIT_PAIR_POINTS)


def pair_codebook(head_dim: int) -> torch.Tensor:
    """The [64, 2] float32 points for a unit key of ``head_dim`` rotated
    coordinates (each about N(0, 1 / head_dim)), as fp16 values."""
    points = torch.tensor(UNIT_PAIR_POINTS, dtype=torch.float64)
    return (points / math.sqrt(head_dim)).half().float()


# The search table's cells per coordinate, and where its rows start.
PAIR_CELLS = 8
_CANDIDATE_ROW = PAIR_POINTS + PAIR_CELLS
# Every coordinate of a rotated unit key lies in [-1, 1]; the outer cells
# end at 2, so fp32 rounding of the rotation stays inside them.
_COORDINATE_BOUND = 2.0
# A point is left out of a cell only if another is nearer by this share of
# their squared distances everywhere in the cell: far above the fp32 error of
# the store's distances (a few 2**-24 of them), so no pair's nearest point
# under fp32 arithmetic is left out.
_PRUNE_MARGIN = 1e-6


def pair_search_table(points: torch.Tensor) -> torch.Tensor:
    """The store's search table for a pair codebook ``points`` ([64, 2]).

    Rows 0-63 are the points. Rows 64-70 hold the cell bounds, x in column 0
    and y in column 1: midway between the 8th and 9th, 16th and 17th, ...
    of the points' sorted coordinates (row 71 is padding). From row 72 each
    of the 8 x 8 cells (``8 * x cell + y cell``) lists ``K`` candidates as
    point numbers in column 0, ascending, the last repeated to fill ``K``:
    every point not nearer than some other point by ``_PRUNE_MARGIN`` at all
    four corners of the cell. The squared distance to a point is affine in
    the pair minus that of another, so one that loses at the four corners
    loses everywhere inside. Computed in float64 from the fp32 points and
    bounds the store reads, once per codebook (every layer of a head size
    holds the same one)."""
    check_pair_codebook(points, 3)
    table = _search_table(tuple(points.detach().cpu().flatten().tolist()))
    return table.to(points.device, copy=True)


@functools.lru_cache(maxsize=8)
def _search_table(flat_points: tuple[float, ...]) -> torch.Tensor:
    points = torch.tensor(flat_points, dtype=torch.float32).view(PAIR_POINTS, 2)
    p = points.double()
    rank = torch.arange(1, PAIR_CELLS) * (PAIR_POINTS // PAIR_CELLS)
    ordered = p.sort(dim=0).values
    bounds = ((ordered[rank - 1] + ordered[rank]) / 2).float().double()
    edge = torch.full((1, 2), _COORDINATE_BOUND, dtype=torch.float64)
    edges = torch.cat([-edge, bounds, edge])  # [9, 2]
    cell = torch.arange(PAIR_CELLS * PAIR_CELLS)
    x = edges[:, 0][torch.stack([cell // PAIR_CELLS, cell // PAIR_CELLS + 1], 1)]
    y = edges[:, 1][torch.stack([cell % PAIR_CELLS, cell % PAIR_CELLS + 1], 1)]
    corners = torch.stack(
        [x[:, :, None].expand(-1, 2, 2), y[:, None, :].expand(-1, 2, 2)], -1
    ).reshape(-1, 4, 2)  # [cells, 4, 2]
    dist = ((corners[:, :, None, :] - p) ** 2).sum(-1)  # [cells, 4, points]
    # gap[c, k, n, m]: how much farther point n is than point m at corner k.
    gap = dist[:, :, :, None] - dist[:, :, None, :]
    scale = dist[:, :, :, None] + dist[:, :, None, :]
    beaten = (gap > _PRUNE_MARGIN * scale).all(1).any(-1)  # [cells, points]
    candidates = [torch.nonzero(~row).flatten() for row in beaten]
    width = max(len(c) for c in candidates)
    lists = torch.stack(
        [torch.cat([c, c[-1:].expand(width - len(c))]) for c in candidates]
    )
    table = torch.zeros(_CANDIDATE_ROW + lists.numel(), 2, dtype=torch.float32)
    table[:PAIR_POINTS] = points
    table[PAIR_POINTS : PAIR_POINTS + PAIR_CELLS - 1] = bounds.float()
    table[_CANDIDATE_ROW:, 0] = lists.flatten().float()
    return table


def pair_search_candidates(table: torch.Tensor, mse_bits: int) -> int:
    """Candidates per cell of a pair codebook as the store takes it: 0 for
    the 64 points alone (each pair compared with all of them), ``K`` for a
    ``pair_search_table``. Refuses anything else."""
    rows = table.shape[0]
    if rows == PAIR_POINTS:
        check_pair_codebook(table, mse_bits)
        return 0
    cells = PAIR_CELLS * PAIR_CELLS
    if (
        mse_bits != 3
        or rows <= _CANDIDATE_ROW
        or (rows - _CANDIDATE_ROW) % cells
        or table.shape[1] != 2
        or table.dtype != torch.float32
        or not table.is_contiguous()
    ):
        raise ValueError(
            f"the store takes a pair codebook as its [{PAIR_POINTS}, 2] points or "
            f"as pair_search_table(points) ([{_CANDIDATE_ROW} + {cells} K, 2] "
            f"float32) for 3-bit keys, got {tuple(table.shape)} {table.dtype} for "
            f"{mse_bits}-bit keys"
        )
    return (rows - _CANDIDATE_ROW) // cells


def is_pair_codebook(codebook: torch.Tensor) -> bool:
    """Whether keys coded with ``codebook`` are coded by pairs (a [points, 2]
    table) rather than per coordinate (a vector of levels or midpoints)."""
    return codebook.dim() == 2


def check_pair_codebook(codebook: torch.Tensor, mse_bits: int) -> None:
    """Refuse a pair codebook the kernels cannot read: they take 3-bit keys'
    [64, 2] contiguous float32 points."""
    if (
        mse_bits != 3
        or codebook.shape != (PAIR_POINTS, 2)
        or codebook.dtype != torch.float32
        or not codebook.is_contiguous()
    ):
        raise ValueError(
            f"a pair codebook codes 3-bit keys as a contiguous [{PAIR_POINTS}, 2] "
            f"float32 table, got {tuple(codebook.shape)} {codebook.dtype} for "
            f"{mse_bits}-bit keys; build it with pair_codebook(head_dim)"
        )


@triton.jit
def _pair_distance(a, b, Points_ptr, n):
    dx = a - tl.load(Points_ptr + 2 * n)
    dy = b - tl.load(Points_ptr + 2 * n + 1)
    return dx * dx + dy * dy


@triton.jit
def _nearest_pair_fields(y, Points_ptr, D: tl.constexpr, CANDIDATES: tl.constexpr):
    """[D] rotated coordinates -> [D] 3-bit fields: each pair's nearest
    point ``n`` (the first of equals), ``n % 8`` at its first coordinate and
    ``n // 8`` at its second. ``Points_ptr``: the 64 points, or with
    ``CANDIDATES`` a ``pair_search_table``, whose cell's candidates hold
    every point that can be nearest there, in ascending order: the same
    ``n``, from ``CANDIDATES`` distances instead of 64."""
    a, b = tl.split(tl.reshape(y, [D // 2, 2]))
    best = tl.full([D // 2], float("inf"), tl.float32)
    code = tl.zeros([D // 2], tl.int32)
    if CANDIDATES == 0:
        for n in tl.static_range(64):
            dist = _pair_distance(a, b, Points_ptr, n)
            nearer = dist < best
            best = tl.where(nearer, dist, best)
            code = tl.where(nearer, n, code)
    else:
        # The table's layout (PAIR_CELLS = 8): bounds from row 64, cells'
        # candidates from row 72, two floats a row.
        cell = tl.zeros([D // 2], tl.int32)
        for j in tl.static_range(7):
            cell += 8 * (a >= tl.load(Points_ptr + 128 + 2 * j)).to(tl.int32)
            cell += (b >= tl.load(Points_ptr + 129 + 2 * j)).to(tl.int32)
        listed = Points_ptr + 144 + 2 * CANDIDATES * cell
        for j in tl.static_range(CANDIDATES):
            n = tl.load(listed + 2 * j).to(tl.int32)
            dist = _pair_distance(a, b, Points_ptr, n)
            nearer = dist < best
            best = tl.where(nearer, dist, best)
            code = tl.where(nearer, n, code)
    return tl.reshape(tl.join(code & 7, code >> 3), [D])


@triton.jit
def _pair_point_values(idx, Points_ptr):
    """[N, C] 3-bit fields (pairs of neighbouring columns) -> the [N, C]
    coordinates of each pair's point, gathered from global memory."""
    N: tl.constexpr = idx.shape[0]
    C: tl.constexpr = idx.shape[1]
    lo, hi = tl.split(tl.reshape(idx, [N, C // 2, 2]))
    at = Points_ptr + 2 * (lo + 8 * hi)
    return tl.reshape(tl.join(tl.load(at), tl.load(at + 1)), [N, C])


@triton.jit
def _pair_point_values_held(idx, Points_ptr):
    """``_pair_point_values`` from a copy of the 64 points in registers (or
    shared memory): a global gather per element costs a 64-bit address
    each."""
    N: tl.constexpr = idx.shape[0]
    C: tl.constexpr = idx.shape[1]
    lo, hi = tl.split(tl.reshape(idx, [N, C // 2, 2]))
    code = lo + 8 * hi
    n = tl.arange(0, 64)
    xs = tl.broadcast_to(tl.load(Points_ptr + 2 * n)[:, None], [64, C // 2])
    ys = tl.broadcast_to(tl.load(Points_ptr + 2 * n + 1)[:, None], [64, C // 2])
    return tl.reshape(tl.join(tl.gather(xs, code, 0), tl.gather(ys, code, 0)), [N, C])
