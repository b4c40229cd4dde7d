"""Rotary position embedding kernels (Triton) for 16-bit activations on CUDA, each one launch
where torch's form takes several, rounding where the torch code rounds (`fused.py`'s rule):
- `rotary`: `x * cos + rotate_half(x) * sin` in float32, one rounding at the end;
- `rotary_store`: `rotary` of q and k, with the rotated k and the untouched v written straight
  into their KV pool slots (what `AttentionBackend.store_kv` does), in one kernel;
  (`rope_int8.py`: the same into an int8 pool; both from the row pieces of `rope_rows.py`);
  with `qk_norm` (Qwen3) it first applies the per-head RMSNorms of q and k (`head_rms_norm`,
  rounded as `fused.rms_norm` rounds), so they need no norm kernels, nor copies of the strided
  q and k, of their own (also in `rope_int8.py` and `split_kv_decode.py`); with `added` (LoRA's
  q/k/v products made beside the GEMM) it adds them to the rows it loads, before all that;
- `store_rotated`: the same as the epilogue of the q/k/v GEMM (`skinny_dot`, from 16 rows), so
  neither the q/k/v tensor nor a kernel of its own is needed (`RotaryStore` says where to);
- `cos_sin`: the per-token cos and sin from the positions, in float32 like HF, rounded to the
  16-bit dtype (torch's form is seven kernels: a batch-1 step's kernels before its first layer
  took 19.5 µs with them, 8.7 with this one).
Each launches with programmatic dependent launch where the GPU has it (`pdl.py`). Callers
(`workers/attention/rotary.py`, `attention/flashinfer.py`) use them for CUDA bf16/fp16 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.norms import QKNorm, qk_norm_args
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.rope_rows import halves, head_rms_norm, plus_added, rotate_q


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    cs_stride,
    num_heads,
    HALF: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependents(PDL)
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    cos = tl.load(cos_ptr + token * cs_stride + dims).to(tl.float32)  # first half == second half
    sin = tl.load(sin_ptr + token * cs_stride + dims).to(tl.float32)
    src = x_ptr + token * x_token_stride + heads * x_head_stride + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * num_heads * 2 * HALF + heads * 2 * HALF + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[T, H, D]` (last dim contiguous), `cos`/`sin` `[T, 1, D]` -> new `[T, H, D]`."""
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            HALF=dim // 2,
            HEADS_BLOCK=triton.next_power_of_2(heads),
            num_warps=4,
            **pdl.launch_options(x),
        )
    return out


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kv_ptr, slot_pages_ptr, slot_offsets_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cs_stride,
    kv_stride_page, kv_stride_kv, kv_stride_slot, kv_stride_head, num_q_heads, num_kv_heads,
    k_inv_scale, v_inv_scale, qn_ptr, kn_ptr, eps, added_ptr, added_stride_t,
    HALF: tl.constexpr, Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, KV_MAX: tl.constexpr,
    QK_NORM: tl.constexpr, ADDED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    added = added_ptr + token * added_stride_t  # the token's [Hq + 2 Hkv, D] heads to add
    cos, sin = rotate_q(q_ptr, cos_ptr, sin_ptr, q_out_ptr, token, q_stride_t, q_stride_h,
                         cs_stride, num_q_heads, qn_ptr, eps, HALF, Q_BLOCK, QK_NORM, added,
                         ADDED)  # fmt: skip
    # k (normed: QK_NORM, rotated) and v (as is): into slot (page, offset) of the layer's pool view.
    page = tl.load(slot_pages_ptr + token).to(tl.int64)
    slot = tl.load(slot_offsets_ptr + token).to(tl.int64)
    kh = tl.arange(0, KV_BLOCK)[:, None]
    km = kh < num_kv_heads
    dims = tl.arange(0, HALF)[None, :]
    k_dst = kv_ptr + page * kv_stride_page + slot * kv_stride_slot + kh * kv_stride_head + dims
    y1, y2 = halves(k_ptr + token * k_stride_t + kh * k_stride_h, km, HALF)
    y1, y2 = plus_added(y1, y2, added + (num_q_heads + kh) * 2 * HALF, km, HALF,
                        k_ptr.dtype.element_ty, ADDED)  # fmt: skip
    if QK_NORM:
        y1, y2 = head_rms_norm(y1, y2, kn_ptr, eps, HALF, k_ptr.dtype.element_ty)
    ty = kv_ptr.dtype.element_ty
    k1 = _kv_value((y1 * cos - y2 * sin) * k_inv_scale, KV_MAX)
    tl.store(k_dst, k1.to(ty), mask=km)
    k2 = _kv_value((y2 * cos + y1 * sin) * k_inv_scale, KV_MAX)
    tl.store(k_dst + HALF, k2.to(ty), mask=km)
    v1, v2 = halves(v_ptr + token * v_stride_t + kh * v_stride_h, km, HALF)
    v1, v2 = plus_added(v1, v2, added + (num_q_heads + num_kv_heads + kh) * 2 * HALF, km, HALF,
                        v_ptr.dtype.element_ty, ADDED)  # fmt: skip
    v_dst = k_dst + kv_stride_kv
    tl.store(v_dst, _kv_value(v1 * v_inv_scale, KV_MAX).to(ty), mask=km)
    tl.store(v_dst + HALF, _kv_value(v2 * v_inv_scale, KV_MAX).to(ty), mask=km)


@dataclass(frozen=True)
class RotaryStore:
    """Where a q/k/v GEMM with the rotary epilogue (`skinny_gemm.skinny_linear(rotary=...)`)
    puts its results, as `rotary_store` would: the step's `cos`/`sin` `[T, 1, D]`, one layer's
    pool view `kv` `[pages, 2, page_size, Hkv, D]`, the tokens' slots and the K/V scales."""

    cos: torch.Tensor
    sin: torch.Tensor
    kv: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    k_scale: float
    v_scale: float
    num_q_heads: int

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[-1]

    def write(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_norm: QKNorm | None,
        added: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """`rotary_store` of q, k and v (and `added`) here: what the epilogue would have done
        with them, by the kernel of its own (for a GEMM that does not rotate: LoRA's)."""
        return rotary_store(q, k, v, self.cos, self.sin, self.kv, self.slot_pages,
                            self.slot_offsets, self.k_scale, self.v_scale, qk_norm,
                            added)  # fmt: skip


@triton.jit
def store_rotated(
    y, offs_m, M, tile, q_ptr, cos_ptr, sin_ptr, kv_ptr, slot_pages_ptr, slot_offsets_ptr,
    cs_stride, kv_stride_page, kv_stride_kv, kv_stride_slot, kv_stride_head,
    num_q_heads, num_kv_heads, k_inv_scale, v_inv_scale,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr, KV_MAX: tl.constexpr,
):  # fmt: skip
    """The q/k/v GEMM's epilogue for a tile of `skinny_tiles.rotary_columns` (y `[BLOCK_M,
    BLOCK_N]` fp32, already rounded to q's dtype as the GEMM would store it): what
    `_rotary_store_kernel` does with those values, in the same float32 arithmetic. A tile lies
    in one head: q heads are rotated into q `[M, Hq, 2 * HALF]`, k heads rotated and v heads as
    they are written into their rows' KV slots."""
    per_head: tl.constexpr = 2 * HALF // BLOCK_N
    head = tile // per_head
    dims = (tile % per_head) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)[None, :]
    x1, x2 = tl.split(tl.reshape(y, [y.shape[0], BLOCK_N // 2, 2]))
    rows = offs_m.to(tl.int64)[:, None]
    mask = rows < M
    if head < num_q_heads + num_kv_heads:  # q or k: rotated
        cos = tl.load(cos_ptr + rows * cs_stride + dims, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + rows * cs_stride + dims, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < num_q_heads:
        q_dst = q_ptr + rows * num_q_heads * 2 * HALF + head * 2 * HALF + dims
        tl.store(q_dst, x1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_dst + HALF, x2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        is_v = head >= num_q_heads + num_kv_heads
        kv_head = head - num_q_heads - is_v * num_kv_heads
        inv_scale = tl.where(is_v, v_inv_scale, k_inv_scale)
        page = tl.load(slot_pages_ptr + rows, mask=mask, other=0).to(tl.int64)
        slot = tl.load(slot_offsets_ptr + rows, mask=mask, other=0).to(tl.int64)
        dst = (kv_ptr + page * kv_stride_page + is_v * kv_stride_kv + slot * kv_stride_slot
               + kv_head * kv_stride_head + dims)  # fmt: skip
        ty = kv_ptr.dtype.element_ty
        tl.store(dst, _kv_value(x1 * inv_scale, KV_MAX).to(ty), mask=mask)
        tl.store(dst + HALF, _kv_value(x2 * inv_scale, KV_MAX).to(ty), mask=mask)


def kv_max(kv: torch.Tensor) -> float:
    """What `_kv_value` saturates to in pool `kv`: an FP8 pool's range, 0 (none) for 16 bits."""
    return torch.finfo(kv.dtype).max if kv.element_size() == 1 else 0.0


@triton.jit
def _kv_value(x, KV_MAX: tl.constexpr):
    """`x` saturated to an FP8 pool's range (KV_MAX > 0), as `kv_dtype.quantize` does."""
    if KV_MAX > 0:
        x = tl.minimum(tl.maximum(x, -KV_MAX), KV_MAX)
    return x


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: QKNorm | None = None,
    added: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` (`cos`/`sin` `[T, 1, D]`); write k and v
    `[T, Hkv, D]` into `kv` `[pages, 2, page_size, Hkv, D]` at (`slot_pages[t]`,
    `slot_offsets[t]`), an FP8 `kv` as `kv_dtype.quantize` stores them (divided by the scale,
    saturated); return the rotated q as a new packed tensor. `qk_norm`: q's and k's per-head
    RMSNorms, applied before the rotation (`head_rms_norm`). `added` `[T, Hq + 2 Hkv, D]`
    (contiguous rows; a LoRA's q/k/v products): added to q, k and v first, as an add into
    their tensor would round it, so that no launch of its own adds them."""
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (tokens, num_kv_heads, dim) and kv.shape[-2:] == k.shape[1:]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kv.stride(-1) == cos.stride(-1) == 1
    assert cos.stride() == sin.stride() and slot_pages.shape == slot_offsets.shape == (tokens,)
    if added is not None:
        assert added.shape == (tokens, num_q_heads + 2 * num_kv_heads, dim)
        assert added.stride()[1:] == (dim, 1) and added.dtype == q.dtype
    out = torch.empty((tokens, num_q_heads, dim), dtype=q.dtype, device=q.device)
    if tokens:
        _rotary_store_kernel[(tokens,)](
            q, k, v, cos, sin, out, kv, slot_pages, slot_offsets, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), kv.stride(0),
            kv.stride(1), kv.stride(2), kv.stride(3), num_q_heads, num_kv_heads, 1.0 / k_scale,
            1.0 / v_scale, *qk_norm_args(qk_norm, q), q if added is None else added,
            0 if added is None else added.stride(0), HALF=dim // 2,
            Q_BLOCK=triton.next_power_of_2(num_q_heads),
            KV_BLOCK=triton.next_power_of_2(num_kv_heads), KV_MAX=kv_max(kv),
            QK_NORM=qk_norm is not None, ADDED=added is not None, num_warps=4,
            **pdl.launch_options(q),
        )  # fmt: skip
    return out


@triton.jit
def cos_sin_row(pos_ptr, inv_freq, cos_ptr, sin_ptr, t, half, cols):
    """Token t's cos and sin (`inv_freq` loaded, at `cols`), both halves of the row."""
    mask = cols < half
    freqs = tl.load(pos_ptr + t).to(tl.float32) * inv_freq
    dtype = cos_ptr.dtype.element_ty
    cos, sin = tl.cos(freqs).to(dtype), tl.sin(freqs).to(dtype)
    row = t * 2 * half + cols
    for offset in tl.static_range(2):  # both halves of the row: `cat((freqs, freqs))`
        tl.store(cos_ptr + row + offset * half, cos, mask=mask)
        tl.store(sin_ptr + row + offset * half, sin, mask=mask)


@triton.jit
def _cos_sin_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, half, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    start_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inv_freq = tl.load(inv_freq_ptr + cols, mask=cols < half, other=0.0)
    wait_for_inputs(PDL)
    cos_sin_row(pos_ptr, inv_freq, cos_ptr, sin_ptr, t, half, cols)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RotaryEmbedding.cos_sin`: `[T, 1, 2 * len(inv_freq)]` cos and sin in one kernel."""
    half = inv_freq.shape[0]
    shape = (positions.shape[0], 1, 2 * half)
    cos = torch.empty(shape, dtype=dtype, device=positions.device)
    sin = torch.empty(shape, dtype=dtype, device=positions.device)
    if positions.shape[0]:
        _cos_sin_kernel[(positions.shape[0],)](
            positions, inv_freq, cos, sin, half, BLOCK=triton.next_power_of_2(half),
            num_warps=1, **pdl.launch_options(cos),
        )  # fmt: skip
    return cos, sin
