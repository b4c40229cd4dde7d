"""Fused elementwise kernels (Triton) for 16-bit activations on CUDA: norms and SiLU-and-mul.

The eager torch versions of RMSNorm, rotary embedding and SiLU-and-multiply launch 2-7 kernels
each; on a GPU decode step of a small batch those launches, not bytes, set the time (measured on
an H200: ~1100 of a Llama-3-8B step's ~1300 kernels were such, about 2 ms of 6). Each function
here is one kernel and rounds where the torch code rounds, so results match it to bf16 rounding:
- `rms_norm`: float32 statistics, the normalised row cast to the input dtype, then times weight
  (HF's `LlamaRMSNorm`); strided `[T, H, D]` rows (Qwen3's q/k heads) read in place;
- `add_rms_norm`: `residual + x` rounded to the input dtype (what torch's add gives), then
  `rms_norm` of that sum; returns both, so a decoder layer needs no separate add kernel;
- `silu_and_mul`: `silu(gate)` rounded to the input dtype, times `up`, as torch computes it
  (optionally of the input plus a second tensor, added first);
- `add_square_sums`: `y += x` in place, and the next norm's sums of squares of the new rows
  redone (the skinny GEMM's `SUMSQ_SLOTS` float64 sums), for products added after a GEMM that
  wrote them.
Each launches with programmatic dependent launch where the GPU has it (`workers/kernels/pdl.py`).
Rotary's kernels are in `rope.py`. Callers (`workers/model/layers.py`, `llama.py`) use these
only when `applies(x)`, so float32 and CPU runs keep the exact torch arithmetic that the
HF-equality tests pin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.skinny_tiles import SUMSQ_SLOTS


def applies(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride_t, x_stride_h, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    start_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + t * x_stride_t + h * x_stride_h + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * n + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape), into a new contiguous tensor.
    A `[T, H, n]` `x` whose rows are strided (q or k heads, views of the q/k/v GEMM's output)
    is read in place, a program per (t, h): no copy launch first."""
    n = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] <= 65535:  # the grid's y limit
        rows = x
    else:
        rows = x.reshape(-1, 1, n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
    tokens, heads = rows.shape[:2]
    out = torch.empty((tokens, heads, n), dtype=x.dtype, device=x.device)
    if tokens and heads:
        block, warps = triton.next_power_of_2(n), 4 if n <= 2048 else 8
        _rms_norm_kernel[(tokens, heads)](
            rows,
            weight,
            out,
            rows.stride(0),
            rows.stride(1),
            n,
            eps,
            BLOCK=block,
            num_warps=warps,
            **pdl.launch_options(x),
        )
    return out.view(x.shape)


@triton.jit
def add_rms_norm_row(x, r, w, n, eps, dtype: tl.constexpr):
    """One row of `add_rms_norm` from float32 `x`, `r` and `w`: `(norm(r + x), r + x)` in
    `dtype`, rounded where torch's add and `rms_norm` round (also the IPC all-reduce's)."""
    total = (r + x).to(dtype)
    s = total.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / n + eps)
    normed = (s * inv).to(dtype).to(tl.float32)
    return (normed * w).to(dtype), total


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, x_stride, r_stride, n, eps,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out, total = add_rms_norm_row(x, r, w, n, eps, out_ptr.dtype.element_ty)
    tl.store(r_out_ptr + row * n + cols, total, mask=mask)
    tl.store(out_ptr + row * n + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)` for `[T, n]` inputs, in one kernel."""
    assert x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype
    assert x.stride(-1) == 1 and residual.stride(-1) == 1
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    total = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block, warps = triton.next_power_of_2(n), 4 if n <= 2048 else 8
        _add_rms_norm_kernel[(rows,)](
            x,
            residual,
            weight,
            out,
            total,
            x.stride(0),
            residual.stride(0),
            n,
            eps,
            BLOCK=block,
            num_warps=warps,
            **pdl.launch_options(x),
        )
    return out, total


@triton.jit
def _half(ptr, add_ptr, offs, mask, ADDED: tl.constexpr):
    """x's values at `offs` in float32; ADDED: plus `add_ptr`'s, rounded to x's dtype first."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADDED:
        x = (x + tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, add_ptr, out_ptr, x_stride, n, ADDED: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = _half(x_ptr, add_ptr, row * x_stride + cols, mask, ADDED)
    up = _half(x_ptr, add_ptr, row * x_stride + n + cols, mask, ADDED)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, added: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[T, 2n]` holding [gate | up] -> `silu(gate) * up` `[T, n]`; `added` (x's shape and
    strides, e.g. LoRA products made beside the GEMM that wrote x): of `x + added`, rounded as
    torch's add rounds it, in the same launch. CUDA, 16 bits (`layers.silu_and_mul` chooses)."""
    rows, width = x.shape
    n = width // 2
    assert applies(x) and x.stride(-1) == 1 and (added is None or added.stride() == x.stride())
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = 1024
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            x, x if added is None else added, out, x.stride(0), n, ADDED=added is not None,
            BLOCK=block, **pdl.launch_options(x),
        )  # fmt: skip
    return out


@triton.jit
def _add_square_sums_kernel(
    y_ptr, x_ptr, ss_ptr, y_stride, x_stride, n, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    total = (y + x).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * y_stride + cols, total, mask=mask)
    t = total.to(tl.float64)  # as the GEMM epilogue sums them: the stored values, in float64
    slots = tl.arange(0, SLOTS)
    tl.store(ss_ptr + row * SLOTS + slots, tl.where(slots == 0, tl.sum(t * t, axis=0), 0.0))


def add_square_sums(y: torch.Tensor, x: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor:
    """`y += x` (`[T, n]`, rounded to y's dtype), and `sumsq` (`[T, SUMSQ_SLOTS]` float64, what a
    GEMM's epilogue added for y's rows) replaced by the new rows' sums of squares, in one
    kernel where `applies(y)`."""
    assert y.shape == x.shape and y.stride(-1) == 1 and x.stride(-1) == 1
    assert sumsq.shape == (y.shape[0], SUMSQ_SLOTS) and sumsq.dtype == torch.float64
    if not applies(y):
        y.add_(x)
        sumsq.zero_()[:, 0] = y.double().square().sum(dim=1)
        return y
    rows, n = y.shape
    if rows:
        _add_square_sums_kernel[(rows,)](
            y, x, sumsq, y.stride(0), x.stride(0), n, SLOTS=SUMSQ_SLOTS,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8,
            **pdl.launch_options(y),
        )  # fmt: skip
    return y
