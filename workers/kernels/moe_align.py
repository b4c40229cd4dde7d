"""The fused MoE kernel's alignment (Triton, two launches): the (token, slot) pairs grouped by
expert, each expert's run padded to a multiple of BLOCK_M so that every M tile holds one
expert's pairs.

1. `_plan_kernel` (one program): per-expert pair counts (a histogram of the routed ids), the
   padded runs' starts (a prefix sum), each tile's expert (-1 for a tile past the runs), and the
   pair slots filled with the sentinel `pairs`.
2. `_scatter_kernel`: each pair takes the next slot of its expert's run (an atomic add on the
   run's cursor) and writes its index there. The order inside a run is whatever the atomics
   give; it changes no result, since each pair's rows are computed on their own and written to
   the pair's own output row.
Two launches instead of the ~30 small torch ops a sort-based alignment takes: at batch 1 each
of those is a graph node of ~2 us, 48 layers a step. No host sync; the grid size comes from the
bound sum_e ceil(n_e / BLOCK_M) <= min(pairs, pairs / BLOCK_M + E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs

CHUNK = 1024  # pairs (or slots) a loop iteration of the plan takes
TILE_CHUNK = 32  # tiles a loop iteration of the tile -> expert map takes


@triton.jit
def _plan_kernel(
    ids_ptr, n, first, num_local, block_m, tiles, cursor_ptr, tile_expert_ptr, pairs_ptr,
    CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr, E_BINS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the routing's ids
    counts = tl.zeros((E_BINS,), dtype=tl.int32)
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32) - first
        mine = (offs < n) & (e >= 0) & (e < num_local)
        counts += tl.histogram(tl.where(mine, e, E_BINS - 1), E_BINS)  # the last bin: not ours
    bins = tl.arange(0, E_BINS)
    counts = tl.where(bins < num_local, counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(cursor_ptr + bins, starts)
    for t0 in range(0, tiles, TILE_CHUNK):
        t = t0 + tl.arange(0, TILE_CHUNK)
        row = (t * block_m)[:, None]
        hit = (starts[None, :] <= row) & (row < ends[None, :])
        expert = tl.max(tl.where(hit, bins[None, :], -1), axis=1)
        tl.store(tile_expert_ptr + t, expert, mask=t < tiles)
    slots = tiles * block_m + 1
    for s0 in range(0, slots, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + s, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=s < slots)


@triton.jit
def _scatter_kernel(
    ids_ptr, n, first, num_local, cursor_ptr, pairs_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the plan's cursors
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32) - first
    mine = (offs < n) & (e >= 0) & (e < num_local)
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=mine)
    tl.store(pairs_ptr + pos, offs, mask=mine)


def align(
    topk_ids: torch.Tensor, first: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [tiles * block_m + 1] int32: pair indices grouped by expert, each run padded with
    the sentinel `topk_ids.numel()`, the last slot unused; tile_expert [tiles] int32: this
    rank's expert of each tile, or -1) for the experts [first, first + num_local)."""
    n = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    tiles = max(1, min(n, triton.cdiv(n, block_m) + num_local))
    e_bins = triton.next_power_of_2(num_local + 1)
    device = topk_ids.device
    cursor = torch.empty(e_bins, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    pairs = torch.empty(tiles * block_m + 1, dtype=torch.int32, device=device)
    launch = pdl.launch_options(topk_ids)
    _plan_kernel[(1,)](
        ids, n, first, num_local, block_m, tiles, cursor, tile_expert, pairs,
        CHUNK=CHUNK, TILE_CHUNK=TILE_CHUNK, E_BINS=e_bins, num_warps=4, **launch,
    )  # fmt: skip
    _scatter_kernel[(triton.cdiv(n, CHUNK),)](
        ids, n, first, num_local, cursor, pairs, BLOCK=CHUNK, num_warps=4, **launch
    )
    return pairs, tile_expert
