"""The Triton kernels of the one-shot IPC all-reduce (`workers/parallel/ipc_all_reduce.py`).

Each program exchanges its slice of the message through buffers every rank maps from its peers:
copy into this rank's slot, raise a flag in every peer's buffer (release, system scope), wait for
the peers' flags of this call (acquire), then sum every rank's slice in rank order, so every rank
gets the same bits. The protocol and its invariants are in `ipc_all_reduce.py`'s docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workers.kernels.fused import add_rms_norm_row
from workers.kernels.pdl import start_dependents, wait_for_inputs


@triton.jit
def _exchange(
    x, offs, mask, bases_ptr, counters_ptr, idx, rank, max_spins,
    WORLD: tl.constexpr, SLOT_ELEMS: tl.constexpr, REGION: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
):  # fmt: skip
    """Program `idx`'s part of one call: `x` (at `offs` of the message) into this rank's slot,
    flags up, wait for the peers', and the float32 sum of every rank's part in rank order."""
    call = tl.load(counters_ptr + idx) + 1  # this program's calls, this one included
    tl.store(counters_ptr + idx, call)
    slot = (call % 2) * SLOT_ELEMS
    own = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.uint8)) + REGION
    tl.store(own.to(tl.pointer_type(x.dtype)) + slot + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's copy is issued before the flag goes up
    for r in tl.static_range(WORLD):
        peer = tl.load(bases_ptr + r).to(tl.pointer_type(tl.uint8)) + REGION
        flag = (peer + FLAG_OFFSET).to(tl.pointer_type(tl.int64)) + idx * WORLD + rank
        tl.atomic_xchg(flag, call, sem="release", scope="sys")
    mine = (own + FLAG_OFFSET).to(tl.pointer_type(tl.int64)) + idx * WORLD
    for r in tl.static_range(WORLD):
        spins = 0
        while (tl.atomic_add(mine + r, 0, sem="acquire", scope="sys") < call) & (
            (max_spins == 0) | (spins < max_spins)
        ):
            spins += 1
    tl.debug_barrier()
    total = tl.zeros(x.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        peer = tl.load(bases_ptr + r).to(tl.pointer_type(tl.uint8)) + REGION
        part = peer.to(tl.pointer_type(x.dtype)) + slot + offs
        total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return total


@triton.jit
def ipc_all_reduce_kernel(
    x_ptr, bases_ptr, counters_ptr, n, rank, max_spins,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, SLOT_ELEMS: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    total = _exchange(x, offs, mask, bases_ptr, counters_ptr, pid, rank, max_spins,
                      WORLD, SLOT_ELEMS, 0, FLAG_OFFSET)  # fmt: skip
    tl.store(x_ptr + offs, total.to(x.dtype), mask=mask)


@triton.jit
def ipc_all_reduce_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, bases_ptr, counters_ptr, n, rank, eps,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, SLOT_ELEMS: tl.constexpr, REGION: tl.constexpr,
    FLAG_OFFSET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A row a program: the all-reduce of x's row, then `fused.add_rms_norm`'s arithmetic."""
    start_dependents(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    offs = row * n + cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    total = _exchange(x, offs, mask, bases_ptr, counters_ptr, row, rank, 0,
                      WORLD, SLOT_ELEMS, REGION, FLAG_OFFSET)  # fmt: skip
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    summed = total.to(x.dtype).to(tl.float32)  # rounded as the plain all-reduce's output
    out, added = add_rms_norm_row(summed, r, w, n, eps, x.dtype)
    tl.store(r_out_ptr + offs, added, mask=mask)
    tl.store(out_ptr + offs, out, mask=mask)
