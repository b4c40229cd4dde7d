"""What both skinny GEMM kernels (`skinny_gemv`, `skinny_dot`) share: the addressing and loads
of a program's tiles, the scale of an input RMSNorm folded into W, the gated activation, and
the epilogue (bias, residual, the next norm's sums of squares, split-K's sum over programs).
Accumulation is fp32 with one rounding to y's dtype at the end, bias added in fp32 before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

SUMSQ_SLOTS = 8  # float64 sums of squares per row (`finish`): 1/8 of the adds contend on each
_SLOTS = tl.constexpr(SUMSQ_SLOTS)


@triton.jit
def finish(
    acc, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
    HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
):  # fmt: skip
    """Store y = acc (+ bias) (+ res) in y's dtype. SUMSQ_OUT: also add the squares of each
    stored row's values to one of its SUMSQ_SLOTS float64 sums (this program's, by tile): the next
    RMSNorm's variance, so no norm kernel reads y again. The adds land in any order, but in
    float64 the squares of 16-bit values sum exactly unless a row's values span more than
    ~2^18, and even then the order moves only the float64's last bit, not the float32 rms
    (bar a tie one time in ~2^29)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ADD_RESIDUAL:
        acc += res
    y_ptrs = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=mask)
    if SUMSQ_OUT:
        y64 = tl.where(mask, y.to(tl.float64), 0.0)
        slot = ss_ptr + offs_m * _SLOTS + tl.program_id(0) % _SLOTS
        tl.atomic_add(slot, tl.sum(y64 * y64, axis=1), mask=offs_m < M, sem="relaxed")


@triton.jit
def residual_tile(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of the residual that `finish` adds (fp32), or 0."""
    if ADD_RESIDUAL:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ptrs = r_ptr + offs_m[:, None] * stride_r + offs_n[None, :]
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        return 0.0


@triton.jit
def input_scale(ss_ptr, offs_m, M, K, eps, NORM_IN: tl.constexpr):
    """NORM_IN: 1 / rms of each row of x, from the SUMSQ_SLOTS float64 sums of its squares that the
    kernel which wrote x added (`finish`); x is then the input of an RMSNorm whose gain was
    folded into W's columns, and the product scaled by this equals W times the normed x."""
    if NORM_IN:
        slots = tl.arange(0, _SLOTS)[None, :]
        sums = tl.load(ss_ptr + offs_m[:, None] * _SLOTS + slots, mask=(offs_m < M)[:, None])
        return tl.rsqrt((tl.sum(sums, axis=1) / K).to(tl.float32) + eps)
    else:
        return tl.full(offs_m.shape, 1.0, tl.float32)


@triton.jit
def epilogue(
    acc, res, y_ptr, b_ptr, ss_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_y,
    HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Store the [BLOCK_M, BLOCK_N] fp32 tile. With SPLIT_K > 1 each of the tile's programs
    writes its partial sum to the workspace and counts itself in on the tile's lock; the last
    one to arrive adds the partials (in split order, so results do not depend on arrival),
    writes y and resets the lock to 0 for the next launch."""
    if SPLIT_K == 1:
        finish(acc, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
                HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT)  # fmt: skip
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + tl.program_id(2) * M * N, acc, mask=mask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            finish(total, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
                    HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT)  # fmt: skip
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def silu_mul(gate, up, dtype):
    """silu(gate) * up of fp32 products, rounded to `dtype` where `fused.silu_and_mul` rounds
    the unfused path: gate and up as the GEMM stores them, then the activation."""
    gate = gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit
def k_tile(ptrs, k0, K, offs_k, EVEN_K: tl.constexpr, WEIGHT: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of a row block of x or W (zeros past K). W is read once per
    step, so it goes first when L2 evicts, keeping x and the KV cache there."""
    if EVEN_K:
        if WEIGHT:  # noqa: SIM108 - constexpr branches
            tile = tl.load(ptrs, eviction_policy="evict_first")
        else:
            tile = tl.load(ptrs)
    else:
        mask = (k0 + offs_k < K)[None, :]
        if WEIGHT:  # noqa: SIM108 - constexpr branches
            tile = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def rotary_columns(tile, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The W rows of tile `tile` of a q/k/v weight whose heads are 2 * HALF rows, for a rotary
    epilogue (`rope.store_rotated`): each rotated pair (d, d + HALF) of one head side by side,
    local column 2r holding dimension j0 + r and 2r + 1 dimension j0 + r + HALF."""
    per_head: tl.constexpr = 2 * HALF // BLOCK_N
    i = tl.arange(0, BLOCK_N)
    j0 = (tile % per_head) * (BLOCK_N // 2)
    return (tile // per_head) * 2 * HALF + (i % 2) * HALF + j0 + i // 2


@triton.jit
def program_tiles(
    x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROTARY_HALF: tl.constexpr, W_BLOCK: tl.constexpr,
):  # fmt: skip
    """This program's rows of x and y (offs_m), rows of W (offs_n; ROTARY_HALF > 0: a head's
    `rotary_columns`), first K column and pointers to its first K tile of x and W. A tail tile
    re-reads valid rows (modulo); its results are never stored. W_BLOCK > 1: W is stored in
    blocks of that many rows (`weight_blocks`), which the tiles cover without a tail."""
    if ROTARY_HALF > 0:
        offs_n = rotary_columns(tl.program_id(0), BLOCK_N, ROTARY_HALF)
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = tl.program_id(2) * K_PER
    offs_k = tl.arange(0, BLOCK_K)
    if W_BLOCK > 1:  # stride_w: a block's; each stored [K, W_BLOCK], its rows side by side
        blocks = (offs_n // W_BLOCK).to(tl.int64)[:, None] * stride_w
        in_block = (offs_n % W_BLOCK)[:, None] + ((k_start + offs_k) * W_BLOCK)[None, :]
        w_ptrs = w_ptr + blocks + in_block
    else:
        w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_w + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + (offs_m % M)[:, None] * stride_x + (k_start + offs_k)[None, :]
    return offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs


@triton.jit
def lora_products(
    lp_ptr, lm_ptr, lb_ptr, offs_m, offs_n, M, n_b, splits, end0, end1,
    SLOTS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] float32: each row's LoRA products for the output columns `offs_n`
    (rows of B [n_b, SLOTS, R]; R_PAD: R's power of two, 16 or more), from the shrunk rows
    `lp_ptr` ([splits, M, PARTS x R] float32 partial sums, `lora_sgmv.shrink`) and the one-hot
    slots `lm_ptr` [M, SLOTS]. A tile lies in one part (the launcher checks): its first
    column's, by `end0`/`end1`. Each slot present in the tile's rows reads its B rows once,
    for all of them."""
    j = tl.arange(0, R_PAD)
    first = tl.min(offs_n, axis=0)
    part = (first >= end0).to(tl.int32) + (first >= end1)
    rows = (offs_m < M)[:, None] & (j < R)[None, :]
    at = lp_ptr + offs_m[:, None] * (PARTS * R) + part * R + j[None, :]
    s = tl.load(at, mask=rows, other=0.0)
    for split in range(1, splits):
        s += tl.load(at + split * M * (PARTS * R), mask=rows, other=0.0)
    acc = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        mine = tl.load(lm_ptr + offs_m * SLOTS + slot, mask=offs_m < M, other=0.0) != 0
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            b = tl.load(lb_ptr + offs_n[:, None] * (SLOTS * R) + slot * R + j[None, :],
                        mask=(offs_n < n_b)[:, None] & (j < R)[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            # tf32 products: 10 bits of the shrunk rows' mantissa, below the output's rounding
            acc = tl.dot(tl.where(mine[:, None], s, 0.0), tl.trans(b), acc,
                         input_precision="tf32")  # fmt: skip
    return acc
