"""The per-token row pieces the rotary kernels share (`rope.py`, `rope_int8.py`,
`split_kv_decode.py`), as Triton functions: a row's two halves loaded in float32 (`halves`),
LoRA's products added to them (`plus_added`), Qwen3's per-head RMSNorm (`head_rms_norm`) and a
token's q heads rotated (`rotary_q_rows`, `rotate_q`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_rms_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr, dtype: tl.constexpr):
    """The per-head RMSNorm (Qwen3's q/k norms) of rows `[x1 | x2]` (float32 halves `[R, HALF]`
    or `[HALF]`) with weight `w_ptr` `[2 * HALF]`, rounded where `fused.rms_norm` rounds (to
    `dtype` after the 1/rms scale, again after the weight): the float32 halves of that `dtype`
    result, what a rotary kernel loads from a normed tensor. The row's sum of squares is both
    halves' (rows of zeros, masked heads, give zeros)."""
    sumsq = tl.sum(x1 * x1, axis=-1, keep_dims=True) + tl.sum(x2 * x2, axis=-1, keep_dims=True)
    inv = tl.rsqrt(sumsq / (2 * HALF) + eps)
    dims = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + dims).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + dims).to(tl.float32)
    y1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def rotary_q_rows(q_ptr, cos_ptr, sin_ptr, token, q_stride_t, q_stride_h, cs_stride,
                  num_q_heads, qn_ptr, eps, HALF: tl.constexpr, Q_BLOCK: tl.constexpr,
                  QK_NORM: tl.constexpr, added=None, ADDED: tl.constexpr = False):  # fmt: skip
    """`token`'s q heads after the rotary embedding (float32 halves `[Q_BLOCK, HALF]`; with
    ADDED plus the heads at `added` first (`plus_added`); with QK_NORM after q's norm (weight
    `qn_ptr`) next), their mask, its cos and sin (`[1, HALF]` float32: a row's first half is
    its second), and where its rows go in a packed `[T, Hq, D]` q (pointer offsets)."""
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + token * cs_stride + dims).to(tl.float32)
    sin = tl.load(sin_ptr + token * cs_stride + dims).to(tl.float32)
    qh = tl.arange(0, Q_BLOCK)[:, None]
    qm = qh < num_q_heads
    x1, x2 = halves(q_ptr + token * q_stride_t + qh * q_stride_h, qm, HALF)
    if ADDED:
        x1, x2 = plus_added(x1, x2, added + qh * 2 * HALF, qm, HALF, q_ptr.dtype.element_ty,
                            ADDED)  # fmt: skip
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, qn_ptr, eps, HALF, q_ptr.dtype.element_ty)
    dst = token * num_q_heads * 2 * HALF + qh * 2 * HALF + dims
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, qm, cos, sin, dst


@triton.jit
def rotate_q(q_ptr, cos_ptr, sin_ptr, q_out_ptr, token, q_stride_t, q_stride_h, cs_stride,
             num_q_heads, qn_ptr, eps, HALF: tl.constexpr, Q_BLOCK: tl.constexpr,
             QK_NORM: tl.constexpr, added=None, ADDED: tl.constexpr = False):  # fmt: skip
    """`token`'s cos and sin (`[1, HALF]` float32: a row's first half is its second), and its
    q heads (`added`'s added with ADDED, normed with QK_NORM) rotated into the new packed
    `[T, Hq, D]` `q_out`."""
    y1, y2, qm, cos, sin, dst = rotary_q_rows(
        q_ptr, cos_ptr, sin_ptr, token, q_stride_t, q_stride_h, cs_stride, num_q_heads, qn_ptr,
        eps, HALF, Q_BLOCK, QK_NORM, added, ADDED,
    )  # fmt: skip
    ty = q_out_ptr.dtype.element_ty
    tl.store(q_out_ptr + dst, y1.to(ty), mask=qm)
    tl.store(q_out_ptr + dst + HALF, y2.to(ty), mask=qm)
    return cos, sin


@triton.jit
def halves(src, mask, HALF: tl.constexpr):
    """The two halves (`[R, HALF]`, float32) of the rows at `src` (`[R, 1]` pointers)."""
    dims = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + dims, mask=mask, other=0.0).to(tl.float32)
    return x1, tl.load(src + HALF + dims, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def plus_added(x1, x2, added, mask, HALF: tl.constexpr, dtype: tl.constexpr,
               ADDED: tl.constexpr):  # fmt: skip
    """Halves `x1`/`x2` plus the rows at `added` (`[R, 1]` pointers; a LoRA's q/k/v products),
    rounded to `dtype` as adding them into x's tensor would, where ADDED; else as they are."""
    if ADDED:
        a1, a2 = halves(added, mask, HALF)
        x1, x2 = (x1 + a1).to(dtype).to(tl.float32), (x2 + a2).to(dtype).to(tl.float32)
    return x1, x2
