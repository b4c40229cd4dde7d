"""The fused MoE kernel's alignment (Triton, two launches): the (token, slot) pairs grouped by
expert, each expert's run padded to a multiple of BLOCK_M so that every M tile holds one
expert's pairs.

1. `_count_kernel`: each program a histogram of its chunk of the routed ids, stored as a row of
   partial counts; the last program to arrive (a counter, acq_rel, reset by that program for the
   next launch, as `moe_route.route_fused`'s) sums the rows and stores each expert's run: its
   start (a prefix sum of the padded counts), its pair count, and a cursor at its start.
2. `_scatter_kernel`: each pair takes the next slot of its expert's run (an atomic add on the
   run's cursor) and writes its index there; program e also fills expert e's padding with the
   sentinel `pairs` and writes e as its tiles' expert; tiles past the runs get -1 (their slots
   are left as they are: the expert kernels return at once on such a tile). The order inside a
   run is whatever the atomics give; it changes no result, since each pair's rows are computed
   on their own and written to the pair's own output row.
Both are spread over the pairs: with a one-program count (a loop over 64 dependent chunks, the
padding and the tile map too) the two took 0.26 ms a layer at a prefill of 8,192 tokens (65,536
pairs) on an H100, 7% of the step. At decode the count is one program. No host sync; the grid
size comes from the bound sum_e ceil(n_e / BLOCK_M) <= min(pairs, pairs / BLOCK_M + E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.arrivals import arrival_counters
from workers.kernels.pdl import start_dependents, wait_for_inputs

COUNT_CHUNK = 4096  # pairs a program of the count takes
SCATTER_CHUNK = 1024  # pairs a program of the scatter takes
ROWS = 16  # partial-count rows the last program sums at once
TILE_CHUNK = 64  # tiles a loop iteration of the tile -> expert map takes


@triton.jit
def _count_kernel(
    ids_ptr, n, first, num_local, block_m, partial_ptr, ticket_ptr, runs_ptr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, E_BINS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the routing's ids
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32) - first
    mine = (offs < n) & (e >= 0) & (e < num_local)
    bins = tl.arange(0, E_BINS)
    counts = tl.histogram(tl.where(mine, e, E_BINS - 1), E_BINS)  # the last bin: not ours
    tl.store(partial_ptr + pid * E_BINS + bins, counts)
    tl.debug_barrier()  # every thread's counts are stored before the ticket is taken
    programs = tl.num_programs(0)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == programs - 1:
        total = tl.zeros((E_BINS,), dtype=tl.int32)
        rows = tl.arange(0, ROWS)
        for r0 in range(0, programs, ROWS):
            ok = (r0 + rows < programs)[:, None]
            part = tl.load(partial_ptr + (r0 + rows)[:, None] * E_BINS + bins[None, :], mask=ok,
                           other=0, cache_modifier=".cg")  # fmt: skip
            total += tl.sum(part, axis=0)
        total = tl.where(bins < num_local, total, 0)
        padded = (total + block_m - 1) // block_m * block_m
        starts = tl.cumsum(padded, 0) - padded
        tl.store(runs_ptr + bins, starts)  # the cursors the scatter moves
        tl.store(runs_ptr + E_BINS + bins, starts)
        tl.store(runs_ptr + 2 * E_BINS + bins, total)
        tl.store(runs_ptr + 3 * E_BINS, tl.sum(padded, axis=0))  # where the runs end
        tl.atomic_xchg(ticket_ptr, 0)  # for the next launch


@triton.jit
def _scatter_kernel(
    ids_ptr, n, first, num_local, tiles, runs_ptr, pairs_ptr, tile_expert_ptr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, TILE_CHUNK: tl.constexpr, E_BINS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the count's runs
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32) - first
    mine = (offs < n) & (e >= 0) & (e < num_local)
    pos = tl.atomic_add(runs_ptr + e, 1, mask=mine)
    tl.store(pairs_ptr + pos, offs, mask=mine)
    chunk = tl.arange(0, TILE_CHUNK)
    if pid < num_local:  # expert pid's padding and tiles
        start = tl.load(runs_ptr + E_BINS + pid)
        size = tl.load(runs_ptr + 2 * E_BINS + pid)
        end = start + (size + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad = start + size + tl.arange(0, BLOCK_M)
        tl.store(pairs_ptr + pad, tl.zeros((BLOCK_M,), dtype=tl.int32) + n, mask=pad < end)
        for t0 in range(start // BLOCK_M, end // BLOCK_M, TILE_CHUNK):
            t = t0 + chunk
            tl.store(tile_expert_ptr + t, tl.zeros((TILE_CHUNK,), tl.int32) + pid,
                     mask=t < end // BLOCK_M)  # fmt: skip
    used = tl.load(runs_ptr + 3 * E_BINS) // BLOCK_M
    step = tl.num_programs(0) * TILE_CHUNK
    for t0 in range(used + pid * TILE_CHUNK, tiles, step):  # tiles past the runs
        t = t0 + chunk
        tl.store(tile_expert_ptr + t, tl.zeros((TILE_CHUNK,), tl.int32) - 1, mask=t < tiles)


def align(
    topk_ids: torch.Tensor, first: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [tiles * block_m + 1] int32: pair indices grouped by expert, each run padded with
    the sentinel `topk_ids.numel()`; the slots of tiles past the runs and the last slot unset;
    tile_expert [tiles] int32: this rank's expert of each tile, or -1) for the experts
    [first, first + num_local)."""
    n = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    tiles = max(1, min(n, triton.cdiv(n, block_m) + num_local))
    e_bins = triton.next_power_of_2(num_local + 1)
    device = topk_ids.device
    counters = triton.cdiv(max(n, 1), COUNT_CHUNK)
    partial = torch.empty(counters, e_bins, dtype=torch.int32, device=device)
    runs = torch.empty(3 * e_bins + 1, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    pairs = torch.empty(tiles * block_m + 1, dtype=torch.int32, device=device)
    launch = pdl.launch_options(topk_ids)
    _count_kernel[(counters,)](
        ids, n, first, num_local, block_m, partial, arrival_counters("moe_align", 1, device), runs,
        CHUNK=COUNT_CHUNK, ROWS=ROWS, E_BINS=e_bins, num_warps=4, **launch,
    )  # fmt: skip
    _scatter_kernel[(max(triton.cdiv(n, SCATTER_CHUNK), num_local),)](
        ids, n, first, num_local, tiles, runs, pairs, tile_expert, CHUNK=SCATTER_CHUNK,
        BLOCK_M=block_m, TILE_CHUNK=TILE_CHUNK, E_BINS=e_bins, num_warps=4, **launch,
    )  # fmt: skip
    return pairs, tile_expert
