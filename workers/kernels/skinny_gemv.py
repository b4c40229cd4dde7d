"""The skinny GEMM's GEMV kernel (M <= 8 rows): each program streams BLOCK_N rows of W with wide
loads and multiplies them elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced once
at the end, so the loop holds no shuffles; a small BLOCK_N gives enough programs to keep every
multiprocessor's loads in flight. GATED computes silu(gate) * up of a [gate; up] weight (an
MLP's gate_up projection) in the same pass, so no activation kernel follows.

Over a weight in blocks of rows (W_BLOCK > 1, `weight_blocks`) a tile of BLOCK_N rows of one
block is contiguous along N and each K step moves BLOCK_K whole rows of the block: with BLOCK_N
the block's width a program's K step is one run of BLOCK_N x BLOCK_K values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.skinny_tiles import (
    epilogue,
    input_scale,
    k_tile,
    program_tiles,
    residual_tile,
    silu_mul,
)


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, r_ptr, ss_in_ptr, ss_out_ptr, M, N, K, K_PER,
    stride_x, stride_w, stride_y, stride_r, eps,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    LOOP_STAGES: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, W_BLOCK: tl.constexpr,
):  # fmt: skip
    """GATED: W holds [gate; up] (2N rows) and y = silu(gate x) * (up x), rounded as
    `fused.silu_and_mul` rounds the unfused product (NORM_IN scales both before it)."""
    start_dependents(PDL)
    offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs = program_tiles(
        x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, 0, W_BLOCK
    )
    # GATED: the up row of each gate row (stride_w: a block's stride where W is blocked)
    u_ptrs = w_ptrs + (N // W_BLOCK) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # The first K tile of W streams in before x, the previous kernel's output, is ready (PDL).
    w = k_tile(w_ptrs, k_start, K, offs_k, EVEN_K, True)
    if GATED:
        up = k_tile(u_ptrs, k_start, K, offs_k, EVEN_K, True)
    wait_for_inputs(PDL)
    x = k_tile(x_ptrs, k_start, K, offs_k, EVEN_K, False).to(tl.float32)[:, None, :]
    # Issued now, their latency hides behind the weight stream.
    inv_rms = input_scale(ss_in_ptr, offs_m, M, K, eps, NORM_IN)
    res = residual_tile(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL)
    acc += w.to(tl.float32)[None, :, :] * x
    if GATED:
        acc_up += up.to(tl.float32)[None, :, :] * x
    for k0 in tl.range(k_start + BLOCK_K, k_start + K_PER, BLOCK_K, num_stages=LOOP_STAGES):
        w_ptrs += BLOCK_K * W_BLOCK  # a K tile's extent in W's memory
        x_ptrs += BLOCK_K
        w = k_tile(w_ptrs, k0, K, offs_k, EVEN_K, True)
        x = k_tile(x_ptrs, k0, K, offs_k, EVEN_K, False).to(tl.float32)[:, None, :]
        acc += w.to(tl.float32)[None, :, :] * x
        if GATED:
            u_ptrs += BLOCK_K * W_BLOCK
            acc_up += k_tile(u_ptrs, k0, K, offs_k, EVEN_K, True).to(tl.float32)[None, :, :] * x
    y = tl.sum(acc, axis=2) * inv_rms[:, None]
    if GATED:
        y = silu_mul(y, tl.sum(acc_up, axis=2) * inv_rms[:, None], y_ptr.dtype.element_ty)
    epilogue(y, res, y_ptr, b_ptr, ss_out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_y,
              HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT, SPLIT_K)  # fmt: skip
