"""Tolerances from the dtype and the reduction length, for tests that compare two correct ways of
computing the same thing whose floating-point operations run in a different order (another GEMM
kernel, BLAS on another CPU, Triton's interpreter). Exact-bit checks belong only where the
arithmetic is exactly defined (a copy, the same kernel on the same values)."""

from __future__ import annotations

import math

import torch

ACC_EPS = torch.finfo(torch.float32).eps  # every GEMM here accumulates in float32


def reduction_atol(k: int, scale: float, out_dtype: torch.dtype = torch.float32) -> float:
    """How far two correct results of a length-`k` float32 reduction may lie apart: rounding
    errors of a sum grow as a random walk, so eps * sqrt(k) of `scale` (the largest sum of the
    terms' magnitudes, e.g. `(|x| @ |w|^T).max()`), plus one rounding to `out_dtype` of each."""
    return scale * (ACC_EPS * math.sqrt(k) + torch.finfo(out_dtype).eps)


def dot_scale(x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest sum of term magnitudes of `x @ w^T`: the `scale` of `reduction_atol`."""
    return float((x.double().abs() @ w.double().abs().T).max())


def assert_within_steps(actual: torch.Tensor, expected: torch.Tensor, steps: int = 1) -> None:
    """`actual` within `steps` representable steps of `expected` in their (low-precision) dtype,
    compared dequantized: rounding a float32 value whose last bits differ may land one step
    apart (a step at |v| is at most eps * |v|; below the smallest normal, eps * that)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    info = torch.finfo(actual.dtype)
    a, b = actual.double(), expected.double()
    step = info.eps * torch.maximum(torch.maximum(a.abs(), b.abs()), torch.tensor(info.tiny))
    off = (a - b).abs() - steps * step
    worst = tuple(int(i) for i in torch.nonzero(off == off.max())[0])
    assert bool((off <= 0).all()), (
        f"{int((off > 0).sum())} values over {steps} step(s): largest excess "
        f"{float(off.max()):.3g} at {worst}"
    )
