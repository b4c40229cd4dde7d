"""The rotary embedding and the K/V write into an int8 pool in one launch (`rotary_store_int8`):
`rope.rotary_store`'s q and k rotation, then each K/V row rotated by a Hadamard matrix and rounded
to int8 at its own scale, as `kvcache/int8_rows.quantize_rows` stores it. For a decode step read
by `int8_decode` it also gives q rotated by that matrix (in float32, as the kernel reads it),
which otherwise takes two more launches a layer (a cast and a product). With `qk_norm` (Qwen3)
q's and k's per-head RMSNorms come first, in the same launch (`rope_rows.head_rms_norm`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.norms import QKNorm, qk_norm_args
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.rope_rows import halves, head_rms_norm, rotary_q_rows, rotate_q

# 1.5 x 2^23: (x + _ROUND) - _ROUND is x rounded half to even (torch.round) for |x| < 2^22
_ROUND = tl.constexpr(12582912.0)
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: a zero row's divisor


@triton.jit
def _store_int8(r, step, dst, mask, HALF: tl.constexpr):
    """`round(r / step)` saturated to +-127, as int8 at `dst` (`[R, 1]` pointers) + 0..HALF."""
    x = tl.math.div_rn(r, step) + _ROUND
    x = tl.minimum(tl.maximum(x - _ROUND, -127.0), 127.0)
    tl.store(dst + tl.arange(0, HALF)[None, :], x.to(tl.int8), mask=mask)


@triton.jit
def _int8_rows(y1, y2, a, dst, dst_scale, mask, HALF: tl.constexpr):
    """Rows `[y1 | y2]` (float32 halves `[R, HALF]`) as `quantize_rows` stores them: rotated by
    H = [[A, A], [A, -A]] / sqrt(2) (`a`: A, the Hadamard matrix of HALF, orthonormal), rounded
    to int8 at max|row| / 127, stored at `dst` (`[R, 1]` byte pointers) with their float32 scale
    at `dst_scale`. Products in float32 (`ieee`): TF32 would round the rows before the int8 step."""
    r1 = tl.dot(y1 + y2, a, input_precision="ieee") * _SQRT_HALF
    r2 = tl.dot(y1 - y2, a, input_precision="ieee") * _SQRT_HALF
    amax = tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1))
    scale = tl.math.div_rn(amax, 127.0)
    step = tl.maximum(scale, _TINY)[:, None]
    _store_int8(r1, step, dst, mask, HALF)
    _store_int8(r2, step, dst + HALF, mask, HALF)
    tl.store(dst_scale, scale[:, None], mask=mask)


@triton.jit
def _rotate_q_by_h(q_ptr, cos_ptr, sin_ptr, a, q_out_ptr, token, q_stride_t, q_stride_h,
                   cs_stride, num_q_heads, qn_ptr, eps, HALF: tl.constexpr, Q_BLOCK: tl.constexpr,
                   QK_NORM: tl.constexpr):  # fmt: skip
    """`rope_rows.rotate_q`'s rows (rounded to q's dtype, as it stores them) times H, stored in
    float32 into `q_out`; returns the token's cos and sin."""
    y1, y2, qm, cos, sin, dst = rotary_q_rows(
        q_ptr, cos_ptr, sin_ptr, token, q_stride_t, q_stride_h, cs_stride, num_q_heads, qn_ptr,
        eps, HALF, Q_BLOCK, QK_NORM,
    )  # fmt: skip
    ty = q_ptr.dtype.element_ty
    y1, y2 = y1.to(ty).to(tl.float32), y2.to(ty).to(tl.float32)
    tl.store(q_out_ptr + dst, tl.dot(y1 + y2, a, input_precision="ieee") * _SQRT_HALF, mask=qm)
    tl.store(q_out_ptr + dst + HALF, tl.dot(y1 - y2, a, input_precision="ieee") * _SQRT_HALF,
             mask=qm)  # fmt: skip
    return cos, sin


@triton.jit
def _rotary_store_int8_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, h_ptr, q_out_ptr, kv_ptr, kvf_ptr, slot_pages_ptr,
    slot_offsets_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cs_stride, kv_stride_page, kv_stride_kv, kv_stride_slot, kv_stride_head, num_q_heads,
    num_kv_heads, qn_ptr, kn_ptr, eps, HALF: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ROTATE_Q: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    a = tl.load(h_ptr + tl.arange(0, HALF)[:, None] * HALF + dims)
    if ROTATE_Q:
        cos, sin = _rotate_q_by_h(q_ptr, cos_ptr, sin_ptr, a, q_out_ptr, token, q_stride_t,
                                  q_stride_h, cs_stride, num_q_heads, qn_ptr, eps, HALF,
                                  Q_BLOCK, QK_NORM)  # fmt: skip
    else:
        cos, sin = rotate_q(q_ptr, cos_ptr, sin_ptr, q_out_ptr, token, q_stride_t, q_stride_h,
                             cs_stride, num_q_heads, qn_ptr, eps, HALF, Q_BLOCK,
                             QK_NORM)  # fmt: skip
    # k (normed: QK_NORM), rotated, rounded to q's dtype (as `rotary` stores it), and v: int8
    # rows in their slot.
    ty = q_ptr.dtype.element_ty
    page = tl.load(slot_pages_ptr + token).to(tl.int64)
    slot = tl.load(slot_offsets_ptr + token).to(tl.int64)
    kh = tl.arange(0, KV_BLOCK)[:, None]
    km = kh < num_kv_heads
    row = page * kv_stride_page + slot * kv_stride_slot + kh * kv_stride_head  # bytes
    y1, y2 = halves(k_ptr + token * k_stride_t + kh * k_stride_h, km, HALF)
    if QK_NORM:
        y1, y2 = head_rms_norm(y1, y2, kn_ptr, eps, HALF, k_ptr.dtype.element_ty)
    k1 = (y1 * cos - y2 * sin).to(ty).to(tl.float32)
    k2 = (y2 * cos + y1 * sin).to(ty).to(tl.float32)
    # Each row's scale after its 2 * HALF bytes, through the pool's float32 view. Rows start
    # 4-byte aligned (strides are multiples of D + 4): said, so the values go 4 bytes a store.
    dst = tl.multiple_of(kv_ptr + row, [4, 4])
    _int8_rows(k1, k2, a, dst, kvf_ptr + (row + 2 * HALF) // 4, km, HALF)
    v1, v2 = halves(v_ptr + token * v_stride_t + kh * v_stride_h, km, HALF)
    row = row + kv_stride_kv
    dst = tl.multiple_of(kv_ptr + row, [4, 4])
    _int8_rows(v1, v2, a, dst, kvf_ptr + (row + 2 * HALF) // 4, km, HALF)


def rotary_store_int8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv: torch.Tensor, half_hadamard: torch.Tensor, slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor, rotate_q_by_h: bool = False, qk_norm: QKNorm | None = None,
) -> torch.Tensor:  # fmt: skip
    """`rotary_store` into an int8 pool `kv` `[pages, 2, page_size, Hkv, D + 4]`: k (rotated,
    rounded to its dtype) and v as rows rotated by the Hadamard matrix H of D, built from
    `half_hadamard` (that of D / 2, float32), and rounded at their own scales; returns q after
    its rotary embedding, or with `rotate_q_by_h` that (rounded to q's dtype) times H, in
    float32: `int8_decode`'s input. `qk_norm`: q's and k's per-head RMSNorms, applied before
    the rotary embedding (`rope_rows.head_rms_norm`)."""
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (tokens, num_kv_heads, dim)
    assert kv.dtype == torch.int8 and kv.shape[-2:] == (num_kv_heads, dim + 4)
    assert half_hadamard.shape == (dim // 2, dim // 2) and half_hadamard.is_contiguous()
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kv.stride(-1) == cos.stride(-1) == 1
    assert cos.stride() == sin.stride() and slot_pages.shape == slot_offsets.shape == (tokens,)
    out_dtype = torch.float32 if rotate_q_by_h else q.dtype
    out = torch.empty((tokens, num_q_heads, dim), dtype=out_dtype, device=q.device)
    q_block = triton.next_power_of_2(num_q_heads)  # rows of the H product: at least 16
    if tokens:
        _rotary_store_int8_kernel[(tokens,)](
            q, k, v, cos, sin, half_hadamard, out, kv, kv.view(torch.float32), slot_pages,
            slot_offsets, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            num_q_heads, num_kv_heads, *qk_norm_args(qk_norm, q), HALF=dim // 2,
            Q_BLOCK=max(16, q_block) if rotate_q_by_h else q_block,
            KV_BLOCK=max(16, triton.next_power_of_2(num_kv_heads)),  # the products' rows
            ROTATE_Q=rotate_q_by_h, QK_NORM=qk_norm is not None,
            # At 4 warps head_dim 128 spills (SM90: 255 registers and 240 B of stack, 1.1 KB
            # with q's H product), as do the q/k norms' rows; at 8 warps none do
            num_warps=8 if dim >= 128 or qk_norm is not None else 4, **pdl.launch_options(q),
        )  # fmt: skip
    return out
