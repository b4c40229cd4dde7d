"""RMSNorm's dispatch, and Qwen3's per-head q/k norms as the attention backends take them
(imports no Triton: the model's CPU path uses both).

`rms_norm` is HF's RMSNorm, one Triton launch on CUDA in 16 bits (`fused.rms_norm`) and the
torch form elsewhere. `QKNorm` carries a layer's q and k norm weights to `forward_rotary`,
whose kernels apply them before the rotary embedding (`rope_rows.head_rms_norm`, rounded as
`fused.rms_norm` rounds); `QKNorm.apply` is the unfused form, for the paths without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)  # CUDA: workers/kernels/fused.py, skinny_gemm.py


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over x's last dimension: float32 statistics, the normalised row rounded to
    x's dtype, then times `weight`."""
    if x.is_cuda and x.dtype in HALF_DTYPES:
        from workers.kernels import fused  # Triton: imported on first CUDA use

        return fused.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@dataclass(frozen=True)
class QKNorm:
    """Qwen3's per-head RMSNorms of q and k (weights `[head_dim]`, one eps), which come before
    the rotary embedding."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(q, self.q_weight, self.eps), rms_norm(k, self.k_weight, self.eps)


def qk_norm_args(
    qk_norm: QKNorm | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A rotary kernel's q/k norm arguments (QK_NORM's): the weights (contiguous `[D]`) and
    eps, or q itself and 0 where there are no norms (QK_NORM off: never read)."""
    if qk_norm is None:
        return q, q, 0.0
    for w in (qk_norm.q_weight, qk_norm.k_weight):
        assert w.shape == q.shape[-1:] and w.stride(-1) == 1 and w.device == q.device
    return qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps
