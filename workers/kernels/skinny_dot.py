"""The skinny GEMM's tensor-core kernel (M > 1 rows): W pipelined through shared memory
(num_stages deep); SWAP puts N on the MMA's M side (y^T = W x^T), which lets wide N tiles use
the larger MMA.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.skinny_tiles import epilogue, input_scale, k_tile, program_tiles, residual_tile


@triton.jit
def dot_step(acc, x, w, SWAP: tl.constexpr):
    if SWAP:  # noqa: SIM108 - a constexpr branch
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, r_ptr, ss_in_ptr, ss_out_ptr, M, N, K, K_PER,
    stride_x, stride_w, stride_y, stride_r, eps,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs = program_tiles(
        x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K
    )
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The first K tile of W streams in before x, the previous kernel's output, is ready (PDL).
    w = k_tile(w_ptrs, k_start, K, offs_k, EVEN_K, True)
    wait_for_inputs(PDL)
    inv_rms = input_scale(ss_in_ptr, offs_m, M, K, eps, NORM_IN)
    acc = dot_step(acc, k_tile(x_ptrs, k_start, K, offs_k, EVEN_K, False), w, SWAP)
    for k0 in range(k_start + BLOCK_K, k_start + K_PER, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = k_tile(w_ptrs, k0, K, offs_k, EVEN_K, True)
        acc = dot_step(acc, k_tile(x_ptrs, k0, K, offs_k, EVEN_K, False), w, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    res = residual_tile(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL)
    epilogue(acc * inv_rms[:, None], res, y_ptr, b_ptr, ss_out_ptr, ws_ptr, lock_ptr, offs_m,
              offs_n, M, N, stride_y, HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT, SPLIT_K)  # fmt: skip
