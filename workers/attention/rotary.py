"""Rotary position embedding (HF "rotate half" convention) with default/linear/llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend the band between.
    old_ctx = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-token `[T, 1, head_dim]` cos and sin, computed in float32 like HF."""
        if positions.is_cuda and dtype in (torch.bfloat16, torch.float16):
            from workers.kernels import rope  # Triton: imported on first CUDA use

            return rope.cos_sin(positions, self.inv_freq, dtype)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and half & (half - 1) == 0:
        from workers.kernels import rope  # Triton: imported on first CUDA use

        return rope.rotary(x, cos, sin)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
