"""What the split-KV decode-attention kernels share: how many splits of a sequence's past, a
tile's K/V loads and online softmax, and how a split hands in its part of the output and the
parts are merged (one launch, no second kernel).

A kernel's programs are (sequence, KV head, split); each split ends with `finish_split`: it
stores its normalised output and log-sum-exp (base 2) and counts itself in on its (sequence,
KV head)'s counter. Where all the launch's programs fit on the GPU at once (`SplitParts.
choose_all_merge`), every split then waits for the count and merges its 1/SPLITS slice of the
output (`_merge_a_slice`: one dependent read of the parts); else the last split to arrive merges
them all (`_merge_all`, as `skinny_gemm`'s split-K), which at batch 1 is one program reading
64 KB after everyone else has finished. With one split the output is written directly.
Used by `split_kv_decode` (16-bit pages, batch 1) and `paged_decode` (8-bit pages).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers import env
from workers.kernels.pdl import start_dependents

TARGET_PROGRAMS = 256  # ~2 per multiprocessor of an H100/H200: enough loads in flight
MAX_SPLITS = 32
LOG2E = 1.4426950408889634


def num_splits(batch_size: int, num_kv_heads: int, target: int = TARGET_PROGRAMS) -> int:
    """Splits of each sequence's past: a power of two giving ~`target` programs."""
    wanted = -(-target // (batch_size * num_kv_heads))
    return min(MAX_SPLITS, 1 << (wanted.bit_length() - 1))


def heads_fit(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels handle these heads: a power-of-two head_dim (its two halves are
    tensor-core operands of 16 or more) and a GQA group of at most 16 query heads (the rows)."""
    half = head_dim // 2
    return (
        head_dim % 2 == 0
        and half >= 16
        and half & (half - 1) == 0
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= 16
    )


@triton.jit
def sequence_pages(indptr_ptr, last_ptr, b, PS: tl.constexpr):
    """Sequence `b`'s first entry in the CSR page list, and its length in tokens."""
    p0 = tl.load(indptr_ptr + b)
    return p0, (tl.load(indptr_ptr + b + 1) - p0 - 1) * PS + tl.load(last_ptr + b)


@triton.jit
def group_rows(q_ptr, q_st, q_sh, b, h, GROUP: tl.constexpr, WIDTH: tl.constexpr, start=0):
    """KV head `h`'s query heads as 16 rows (the tensor-core minimum; rows past the group are
    zeros): `[16, WIDTH]`, columns from `start`."""
    rows = tl.arange(0, 16)
    cols = start + tl.arange(0, WIDTH)
    q_row = q_ptr + b * q_st + (h * GROUP + rows)[:, None] * q_sh + cols[None, :]
    return tl.load(q_row, mask=(rows < GROUP)[:, None], other=0.0)


@triton.jit
def group_queries(q_ptr, q_st, q_sh, b, h, GROUP: tl.constexpr, HALF: tl.constexpr):
    """`group_rows` in two halves `[16, HALF]` as stored."""
    x1 = group_rows(q_ptr, q_st, q_sh, b, h, GROUP, HALF)
    return x1, group_rows(q_ptr, q_st, q_sh, b, h, GROUP, HALF, HALF)


@triton.jit
def tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
             PS: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """K (two rotary halves) and V of past tokens `t` (masked at `end`)."""
    mask = t < end
    page = tl.load(idx_ptr + p0 + t // PS, mask=mask, other=0).to(tl.int64)
    row = kv_ptr + page * s_page + (t % PS).to(tl.int64) * s_slot + h * s_head
    dh = tl.arange(0, HALF)[None, :]
    dd = tl.arange(0, 2 * HALF)[None, :]
    k1 = tl.load(row[:, None] + dh, mask=mask[:, None], other=0.0)
    k2 = tl.load(row[:, None] + HALF + dh, mask=mask[:, None], other=0.0)
    v = tl.load(row[:, None] + s_kv + dd, mask=mask[:, None], other=0.0)
    return k1, k2, v, mask


@triton.jit
def attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2):
    """Online softmax (base 2) of one tile: returns the new running max, sum and output."""
    s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    s = tl.where(mask[None, :], s * scale_log2, float("-inf"))
    top_new = tl.maximum(top, tl.max(s, axis=1))
    alpha = tl.exp2(top - top_new)
    p = tl.exp2(s - top_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return top_new, denom, acc


@triton.jit
def finish_split(
    acc, top, denom, o_scale, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, split,
    num_kv_heads, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr,
    SPLITS: tl.constexpr, ALL_MERGE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Hand in one split's online-softmax state (`acc` `[16, D]` unnormalised, running max
    `top` and sum `denom` in base 2, rows the KV head's query heads) and merge; the output is
    `o_scale` times the attention (an FP8 pool's V scale)."""
    # The next kernel (o_proj) may start now: its first weight loads then overlap this
    # kernel's stores and merge, not its K/V and q/k/v loads (whose latency is this kernel's
    # time). At the start, as the other kernels do, it was 0.004 ms a step slower (1 x 1024).
    start_dependents(PDL)
    rows = tl.arange(0, 16)
    live = rows < GROUP
    dd = tl.arange(0, 2 * HALF)
    o = acc * (o_scale / tl.where(denom > 0.0, denom, 1.0))[:, None]
    if SPLITS == 1:
        out_row = out_ptr + b * (num_kv_heads * GROUP * 2 * HALF) + (h * GROUP + rows) * (2 * HALF)
        tl.store(out_row[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])  # fmt: skip
    else:
        pair = b * num_kv_heads + h
        part = (pair * SPLITS + split) * GROUP_P2 + rows
        tl.store(part_lse_ptr + part, top + tl.log2(denom), mask=live)
        tl.store(part_o_ptr + part[:, None] * (2 * HALF) + dd[None, :], o, mask=live[:, None])
        tl.debug_barrier()  # every thread's part is written before the count goes up
        if ALL_MERGE:
            _merge_a_slice(part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, pair, split,
                           num_kv_heads, GROUP, GROUP_P2, HALF, SPLITS)  # fmt: skip
        elif tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel") == SPLITS - 1:
            _merge_all(part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, pair, num_kv_heads,
                       GROUP, GROUP_P2, HALF, SPLITS)  # fmt: skip


@triton.jit
def _merge_all(
    part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, pair, num_kv_heads,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """The last split of the pair to arrive merges every part, then resets the counter."""
    dd = tl.arange(0, 2 * HALF)
    sp = tl.arange(0, SPLITS)[:, None]
    g = tl.arange(0, GROUP_P2)[None, :]
    gm = g < GROUP
    idx = (pair * SPLITS + sp) * GROUP_P2 + g  # [SPLITS, GROUP_P2]
    lse = tl.load(part_lse_ptr + idx, mask=gm, other=float("-inf"), cache_modifier=".cg")
    weight = tl.exp2(lse - tl.max(lse, axis=0)[None, :])
    weight = weight / tl.sum(weight, axis=0)[None, :]
    parts = tl.load(
        part_o_ptr + idx[:, :, None] * (2 * HALF) + dd[None, None, :],
        mask=gm[:, :, None], other=0.0, cache_modifier=".cg",
    )  # fmt: skip
    out = tl.sum(weight[:, :, None] * parts, axis=0)  # [GROUP_P2, D]
    g1 = tl.arange(0, GROUP_P2)
    out_row = out_ptr + b * (num_kv_heads * GROUP * 2 * HALF) + (h * GROUP + g1) * (2 * HALF)
    tl.store(out_row[:, None] + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g1 < GROUP)[:, None])  # fmt: skip
    tl.atomic_xchg(lock_ptr + pair, 0)


@triton.jit
def _merge_a_slice(
    part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, pair, split, num_kv_heads,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Every split of the pair merges 1/SPLITS of its output once all SPLITS have stored their
    parts, instead of the last one merging all (one program reading every part: ~3 µs a layer
    at batch 1). The pair's counter only grows (by SPLITS a launch, wrapping at 2^32, which
    SPLITS divides): the launch's target is the next multiple of SPLITS above the count this
    split found, and no later launch adds to it before this one has ended (they add after
    their PDL wait). Spinning needs all the launch's programs resident at once
    (`SplitParts.choose_all_merge`). The last split to count itself in knows from its own add
    that all have, and does not poll."""
    old = tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel")
    target = (old & -SPLITS) + SPLITS
    if old + 1 != target:
        while tl.atomic_add(lock_ptr + pair, 0, sem="acquire") != target:
            pass
    SLICE: tl.constexpr = GROUP_P2 * 2 * HALF // SPLITS
    e = split * SLICE + tl.arange(0, SLICE)  # flat indices into this pair's [GROUP_P2, D]
    g = e // (2 * HALF)
    sp = tl.arange(0, SPLITS)[:, None]
    live = (g < GROUP)[None, :]
    row = (pair * SPLITS + sp) * GROUP_P2 + g[None, :]  # [SPLITS, SLICE]
    lse = tl.load(part_lse_ptr + row, mask=live, other=0.0, cache_modifier=".cg")
    parts = tl.load(part_o_ptr + row * (2 * HALF) + (e % (2 * HALF))[None, :], mask=live,
                    other=0.0, cache_modifier=".cg")  # fmt: skip
    weight = tl.exp2(lse - tl.max(lse, axis=0)[None, :])
    out = tl.sum(weight * parts, axis=0) / tl.sum(weight, axis=0)
    out_row = out_ptr + b * (num_kv_heads * GROUP * 2 * HALF) + h * GROUP * 2 * HALF
    tl.store(out_row + e, out.to(out_ptr.dtype.element_ty), mask=g < GROUP)


class SplitParts:
    """A kernel's fixed merge buffers for `batch_size` sequences (CUDA-graph safe: never
    reallocated): each split's output and log-sum-exp, and one counter a (sequence, KV head)."""

    def __init__(
        self, batch_size: int, num_kv_heads: int, group: int, head_dim: int, splits: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.splits = splits
        self.group_p2 = triton.next_power_of_2(group)
        pairs = batch_size * num_kv_heads
        rows = pairs * splits * self.group_p2
        self.part_o = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(rows, dtype=torch.float32, device=device)
        self.locks = torch.zeros(pairs, dtype=torch.int32, device=device)
        # Chosen on the first call (`choose_all_merge`) unless set before it; False: the last
        # split merges all (a comparison's choice).
        self.all_merge: bool | None = None

    def launch(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
               options: dict[str, Any], x: torch.Tensor) -> None:  # fmt: skip
        """`kernel[grid](*args, **options)` with its ALL_MERGE as chosen (`choose_all_merge`)."""
        all_merge = self.choose_all_merge(kernel, grid, args, options, x)
        kernel[grid](*args, ALL_MERGE=all_merge, **options)

    def choose_all_merge(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                         options: dict[str, Any], x: torch.Tensor) -> bool:  # fmt: skip
        """`all_merge`, chosen on the first call from the kernel compiled with ALL_MERGE."""
        if self.all_merge is None:
            # One split: nothing to merge. The interpreter runs programs one after another, so
            # none may wait for another.
            if self.splits == 1 or env.triton_interpret():
                self.all_merge = False
            else:
                compiled = kernel.warmup(*args, grid=grid, ALL_MERGE=True, **options)
                self.all_merge = _all_merge_fits(compiled, grid[0] * grid[1] * grid[2], x)
        return self.all_merge


def _all_merge_fits(compiled: Any, programs: int, x: torch.Tensor) -> bool:
    """Whether the merge by every split (`_merge_a_slice`, whose programs spin until all have
    stored their parts) may run: all `programs` fit on the device at once, by the compiled
    kernel's registers, shared memory and warps (Hopper's limits: 64K registers, allocated 256
    a warp, 32 blocks and 2048 threads a multiprocessor)."""
    compiled._init_handles()  # loads the binary: its register count
    props = torch.cuda.get_device_properties(x.device)
    warps = compiled.metadata.num_warps
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    per_sm = min(
        65536 // (regs_per_warp * warps),
        props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024),
        props.max_threads_per_multi_processor // (32 * warps),
        32,
    )
    return programs <= per_sm * props.multi_processor_count
