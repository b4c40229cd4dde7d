"""The skinny GEMM's tensor-core kernel (M > 1 rows): W pipelined through shared memory
(num_stages deep); SWAP puts N on the MMA's M side (y^T = W x^T), which lets wide N tiles use
the larger MMA. GATED computes silu(gate) * up of a [gate; up] weight with a second W tile and
accumulator a step, as the GEMV kernel does, so no activation kernel follows. ROTARY_HALF
makes it a q/k/v projection that rotates q and k and stores k and v in the KV pool itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from workers.kernels import rope
from workers.kernels import skinny_tiles as tiles
from workers.kernels.pdl import start_dependents, wait_for_inputs


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
    cos_ptr, sin_ptr, kv_ptr, slot_pages_ptr, slot_offsets_ptr, cs_stride, kv_stride_page,
    kv_stride_kv, kv_stride_slot, kv_stride_head, num_q_heads, num_kv_heads, k_inv_scale,
    v_inv_scale, lp_ptr, lm_ptr, lb_ptr, lora_n_b, lora_splits, lora_end0, lora_end1,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
    GATED: tl.constexpr, NORM_IN: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROTARY_HALF: tl.constexpr, KV_MAX: tl.constexpr, W_BLOCK: tl.constexpr,
    LORA_SLOTS: tl.constexpr, LORA_R: tl.constexpr, LORA_R_PAD: tl.constexpr,
    LORA_PARTS: tl.constexpr,
):  # fmt: skip
    """GATED: W holds [gate; up] (2N rows), y = silu(gate x) * (up x), no split-K.
    ROTARY_HALF > 0: W is a q/k/v weight of heads 2 * ROTARY_HALF wide, y the rotated q, and
    k and v go to the KV pool (`rope.store_rotated`; the arguments after eps), no split-K.
    LORA_PARTS > 0: each row's LoRA products (`tiles.lora_products`; the lora_ arguments) are
    added to the tile's sums before anything else: a norm's scale, the activation, rotary."""
    start_dependents(PDL)
    offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs = tiles.program_tiles(
        x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, ROTARY_HALF,
        W_BLOCK,
    )  # fmt: skip
    u_ptrs = w_ptrs + (N // W_BLOCK) * stride_w  # GATED: the up row of each gate row
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    # The first K tile of W streams in before x, the previous kernel's output, is ready (PDL).
    w = tiles.k_tile(w_ptrs, k_start, K, offs_k, EVEN_K, True)
    if GATED:
        up = tiles.k_tile(u_ptrs, k_start, K, offs_k, EVEN_K, True)
    wait_for_inputs(PDL)
    inv_rms = tiles.input_scale(ss_in_ptr, offs_m, M, K, eps, NORM_IN)
    x = tiles.k_tile(x_ptrs, k_start, K, offs_k, EVEN_K, False)
    acc = dot_step(acc, x, w, SWAP)
    if GATED:
        acc_up = dot_step(acc_up, x, up, SWAP)
    for k0 in range(k_start + BLOCK_K, k_start + K_PER, BLOCK_K):
        w_ptrs += BLOCK_K * W_BLOCK
        x_ptrs += BLOCK_K
        w = tiles.k_tile(w_ptrs, k0, K, offs_k, EVEN_K, True)
        x = tiles.k_tile(x_ptrs, k0, K, offs_k, EVEN_K, False)
        acc = dot_step(acc, x, w, SWAP)
        if GATED:
            u_ptrs += BLOCK_K * W_BLOCK
            acc_up = dot_step(acc_up, x, tiles.k_tile(u_ptrs, k0, K, offs_k, EVEN_K, True), SWAP)
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if LORA_PARTS > 0:  # noqa: SIM102 - a constexpr branch; raw rows' products, as acc's
        if tl.program_id(2) == 0:  # split-K: one split's partial takes them
            acc += tiles.lora_products(
                lp_ptr, lm_ptr, lb_ptr, offs_m, offs_n, M, lora_n_b, lora_splits, lora_end0,
                lora_end1, LORA_SLOTS, LORA_R, LORA_R_PAD, LORA_PARTS,
            )  # fmt: skip
            if GATED:  # the up rows: N below their gate rows in W and in B
                acc_up += tiles.lora_products(
                    lp_ptr, lm_ptr, lb_ptr, offs_m, offs_n + N, M, lora_n_b, lora_splits,
                    lora_end0, lora_end1, LORA_SLOTS, LORA_R, LORA_R_PAD, LORA_PARTS,
                )  # fmt: skip
    y = acc * inv_rms[:, None]
    if GATED:
        y = tiles.silu_mul(y, acc_up * inv_rms[:, None], y_ptr.dtype.element_ty)
    if ROTARY_HALF > 0:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
        rope.store_rotated(
            y.to(y_ptr.dtype.element_ty).to(tl.float32), offs_m, M, tl.program_id(0), y_ptr,
            cos_ptr, sin_ptr, kv_ptr, slot_pages_ptr, slot_offsets_ptr, cs_stride, kv_stride_page,
            kv_stride_kv, kv_stride_slot, kv_stride_head, num_q_heads, num_kv_heads, k_inv_scale,
            v_inv_scale, BLOCK_N, ROTARY_HALF, KV_MAX,
        )  # fmt: skip
    else:
        res = tiles.residual_tile(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL)
        tiles.epilogue(y, res, y_ptr, b_ptr, ss_out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N,
                       stride_y, HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT, SPLIT_K)  # fmt: skip
