"""Fused elementwise kernels (Triton) for 16-bit activations on CUDA.

The eager torch versions of RMSNorm, rotary embedding and SiLU-and-multiply launch 2-7 kernels
each; on a GPU decode step of a small batch those launches, not bytes, set the time (measured on
an H200: ~1100 of a Llama-3-8B step's ~1300 kernels were such, about 2 ms of 6). Each function
here is one kernel and rounds where the torch code rounds, so results match it to bf16 rounding:
- `rms_norm`: float32 statistics, the normalised row cast to the input dtype, then times weight
  (HF's `LlamaRMSNorm`);
- `rotary`: `x * cos + rotate_half(x) * sin` in float32, one rounding at the end;
- `silu_and_mul`: `silu(gate)` rounded to the input dtype, times `up`, as torch computes it.
Callers (`workers/model/layers.py`, `rotary.py`, `llama.py`) use them only when `applies(x)`, so
float32 and CPU runs keep the exact torch arithmetic that the HF-equality tests pin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def applies(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block, warps = triton.next_power_of_2(n), 4 if n <= 2048 else 8
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), n, n, eps, BLOCK=block, num_warps=warps
        )
    return out.view(x.shape)


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
):
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
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x` `[T, 2n]` holding [gate | up] -> `silu(gate) * up` `[T, n]`."""
    rows, width = x.shape
    n = width // 2
    assert x.stride(-1) == 1
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = 1024
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out
