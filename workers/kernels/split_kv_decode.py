"""Decode attention for small batches in one Triton kernel: rotary, K/V write, split-KV, merge.

At batch 1 a Llama-3-8B layer's attention reads 4 MB of KV (1 µs at the HBM rate) but took
~12 µs after the q/k/v GEMM on an H200 as three dependent kernels (`rope.rotary_store`,
FlashInfer's split-KV decode, its merge of the splits; docs/notes/attention.md), the weight
stream idle. Here one launch does all of it, and starts reading before its input exists:
- programs are (sequence, KV head, split of the sequence's past tokens); each first loads the page
  ids and the K/V of its first tile: tokens of earlier steps, which no kernel of this forward
  writes, so under programmatic dependent launch (`workers/kernels/pdl.py`) they stream while the
  q/k/v GEMM ends. Then it waits for that GEMM's output;
- it rotates its query heads (the KV head's GQA group, as tensor-core rows) and the new token's
  k; split 0 writes the new k and v into their pool slot and counts the new token in its
  softmax (online, base 2), so no other program reads that slot;
- each split stores its normalised output and log-sum-exp and counts itself in on its
  (sequence, KV head)'s counter; where all the launch's programs fit on the GPU at once, every
  split then waits for the count and merges its 1/SPLITS slice of the output (one dependent
  read of the parts); else the last split to arrive merges them all (as `skinny_gemm`'s
  split-K), which at batch 1 is one program reading 64 KB after everyone else has finished.
Arithmetic as FlashInfer's: bf16 q, K and probabilities into fp32 tensor-core products.

One launch cannot see writes of its own other programs, so a step whose rows include several
tokens of one sequence (a prefill chunk laid out one row per token) must not use it: each row's
past would include the K/V other rows write in the same launch. `engine/cuda_graph.py` never
runs such a step on a graph that uses this kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs

MAX_BATCH = 1  # batch sizes whose decode graphs use this kernel (FlashInfer above)
TILE = 32  # past tokens per inner step
NUM_WARPS = 4
_TARGET_PROGRAMS = 256  # ~2 per multiprocessor of an H100/H200: enough loads in flight
_MAX_SPLITS = 32
_LOG2E = 1.4426950408889634


def applies(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these heads (power-of-two head_dim, a 16-bit pool)."""
    half = head_dim // 2
    return (
        dtype in (torch.bfloat16, torch.float16)
        and head_dim % 2 == 0
        and half >= 16
        and half & (half - 1) == 0
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= 16
    )


def num_splits(batch_size: int, num_kv_heads: int) -> int:
    """Splits of each sequence's past: a power of two giving ~_TARGET_PROGRAMS programs."""
    wanted = -(-_TARGET_PROGRAMS // (batch_size * num_kv_heads))
    return min(_MAX_SPLITS, 1 << (wanted.bit_length() - 1))


@triton.jit
def _tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
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
def _attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2):
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
def _split_kv_decode_kernel(
    q_ptr, k_ptr, v_ptr, q_st, q_sh, k_st, k_sh, v_st, v_sh, cos_ptr, sin_ptr, cs_st,
    kv_ptr, s_page, s_kv, s_slot, s_head, indptr_ptr, idx_ptr, last_ptr, slot_page_ptr,
    slot_off_ptr, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, scale_log2,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, PS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, ALL_MERGE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    p0 = tl.load(indptr_ptr + b)
    kv_len = (tl.load(indptr_ptr + b + 1) - p0 - 1) * PS + tl.load(last_ptr + b)
    past = kv_len - 1  # tokens in the pool before this step; the new one is kv_len - 1
    chunk = tl.cdiv(past, SPLITS)
    start = split * chunk
    end = tl.minimum(start + chunk, past)
    # Before the input is ready (PDL): page ids and K/V of the first tile of the past.
    t = start + tl.arange(0, TILE)
    k1, k2, v, mask = _tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
                               PS, HALF)  # fmt: skip
    wait_for_inputs(PDL)
    # The group's query heads as rows (padded to the 16 a tensor-core product needs), rotated.
    rows = tl.arange(0, 16)
    live = rows < GROUP
    dh = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + b * cs_st + dh).to(tl.float32)  # first half == second half
    sin = tl.load(sin_ptr + b * cs_st + dh).to(tl.float32)
    q_row = q_ptr + b * q_st + (h * GROUP + rows)[:, None] * q_sh + dh[None, :]
    x1 = tl.load(q_row, mask=live[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(q_row + HALF, mask=live[:, None], other=0.0).to(tl.float32)
    q1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(v.dtype)
    q2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(v.dtype)
    # The new token: k rotated; split 0 writes k and v to the pool and starts its softmax there.
    k_row = k_ptr + b * k_st + h * k_sh
    y1 = tl.load(k_row + dh).to(tl.float32)
    y2 = tl.load(k_row + HALF + dh).to(tl.float32)
    kn1 = (y1 * cos - y2 * sin).to(v.dtype)
    kn2 = (y2 * cos + y1 * sin).to(v.dtype)
    dd = tl.arange(0, 2 * HALF)
    vn = tl.load(v_ptr + b * v_st + h * v_sh + dd).to(v.dtype)
    first = split == 0
    slot = (
        kv_ptr + tl.load(slot_page_ptr + b).to(tl.int64) * s_page
        + tl.load(slot_off_ptr + b).to(tl.int64) * s_slot + h * s_head
    )  # fmt: skip
    # `first & (dh < HALF)`: split 0 only, as a mask of the stored vector's shape.
    tl.store(slot + dh, kn1, mask=first & (dh < HALF))
    tl.store(slot + HALF + dh, kn2, mask=first & (dh < HALF))
    tl.store(slot + s_kv + dd, vn, mask=first & (dd < 2 * HALF))
    s_new = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], axis=1)
    s_new += tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], axis=1)
    top = tl.where(first, s_new * scale_log2, -1.0e30)
    denom = tl.where(first, 1.0, 0.0) + tl.zeros([16], dtype=tl.float32)
    acc = tl.where(first, 1.0, 0.0) * vn.to(tl.float32)[None, :] + tl.zeros(
        [16, 2 * HALF], dtype=tl.float32
    )
    top, denom, acc = _attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2)
    for t0 in range(start + TILE, end, TILE):
        t = t0 + tl.arange(0, TILE)
        k1, k2, v, mask = _tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
                                   PS, HALF)  # fmt: skip
        top, denom, acc = _attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2)
    # The next kernel (o_proj) may start now: its first weight loads then overlap this
    # kernel's stores and merge, not its K/V and q/k/v loads (whose latency is this kernel's
    # time). At the start, as the other kernels do, it was 0.004 ms a step slower (1 x 1024).
    start_dependents(PDL)
    # This split's output and log-sum-exp; the last split of the pair to get here merges.
    pair = b * num_kv_heads + h
    part = (pair * SPLITS + split) * GROUP_P2 + rows
    tl.store(part_lse_ptr + part, top + tl.log2(denom), mask=live)
    o = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(part_o_ptr + part[:, None] * (2 * HALF) + dd[None, :], o, mask=live[:, None])
    tl.debug_barrier()  # every thread's part is written before the count goes up
    if ALL_MERGE:
        _merge_a_slice(part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, pair, split,
                       num_kv_heads, GROUP, GROUP_P2, HALF, SPLITS)  # fmt: skip
    elif tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel") == SPLITS - 1:
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
    (`SplitKVDecode` checks the occupancy before choosing it). The last split to count
    itself in knows from its own add that all have, and does not poll."""
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


class SplitKVDecode:
    """The kernel's fixed buffers for decode steps of exactly `batch_size` rows; `forward`
    calls may be captured in a CUDA graph (nothing allocated but the output)."""

    def __init__(
        self, batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.batch_size = batch_size
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale_log2 = scale * _LOG2E
        self.splits = num_splits(batch_size, num_kv_heads)
        self.group_p2 = triton.next_power_of_2(self.group)
        pairs = batch_size * num_kv_heads
        rows = pairs * self.splits * self.group_p2
        self.part_o = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(rows, dtype=torch.float32, device=device)
        self.locks = torch.zeros(pairs, dtype=torch.int32, device=device)
        # Chosen on the first call (`_all_merge_fits`) unless set before it; False: the last
        # split merges all (a comparison's choice).
        self.all_merge: bool | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
        last_page_len: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """q `[B, Hq, D]`, k/v `[B, Hkv, D]` of the new tokens before rotation (`cos`/`sin`
        `[B, 1, D]`); `kv` one layer's pool `[pages, 2, page_size, Hkv, D]`; the page table in
        FlashInfer's CSR form (device tensors). Returns the attention output `[B, Hq, D]`."""
        b, hq, d = q.shape
        assert b == self.batch_size and d == self.head_dim  # the split buffers' sizes
        assert k.shape == v.shape == (b, self.num_kv_heads, d)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kv.stride(-1) == 1
        assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and q.dtype == kv.dtype
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
        grid = (b, self.num_kv_heads, self.splits)
        args = (
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos, sin, cos.stride(0), kv, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            kv_indptr, kv_indices, last_page_len, slot_pages, slot_offsets, self.part_o,
            self.part_lse, self.locks, out, self.scale_log2,
        )  # fmt: skip
        options = dict(
            GROUP=self.group, GROUP_P2=self.group_p2, HALF=d // 2, PS=kv.shape[2], TILE=TILE,
            SPLITS=self.splits, num_warps=NUM_WARPS, **pdl.launch_options(q),
        )  # fmt: skip
        if self.all_merge is None:
            compiled = _split_kv_decode_kernel.warmup(*args, grid=grid, ALL_MERGE=True, **options)
            self.all_merge = _all_merge_fits(compiled, b * self.num_kv_heads * self.splits, q)
        _split_kv_decode_kernel[grid](*args, ALL_MERGE=self.all_merge, **options)
        return out


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
