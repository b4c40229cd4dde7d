"""The `int8` KV cache (`EngineConfig.kv_cache_dtype="int8"`): each (token, head) row of K or V is
stored as `head_dim` signed bytes followed by its own scale, 4 bytes of float32.

A row is `round(x / s)` with `s = max|x| / 127`, so its error is at most `s / 2` everywhere in
the row: about 5x less than E4M3's relative rounding (3 mantissa bits) on the large values that
set a dot product's error. Measured on SmolLM2 (docs/notes/fp8-kv.md), no E4M3 scale or exact
transform came near the bf16 KV cache's accuracy, and this did. The scale sits in the row, so a
page's bytes carry their own scales: the NIXL hand-off, the host/disk tiers and a head slice of
heterogeneous TP move them with the values, and no replica has to agree on anything else.
"""

from __future__ import annotations

from functools import cache

import torch

from workers.protocol import INT8_SCALE_BYTES

INT8_MAX = 127


@cache  # one per (size, device): built once, read at every layer's write and read
def hadamard(dim: int, device: torch.device) -> torch.Tensor | None:
    """The orthonormal, symmetric Sylvester-Hadamard matrix of size `dim` (a power of 2), else
    None: rows are rotated by it before rounding, which spreads a few large channels over all
    of them, and rotated back when read (H H = I, exact up to float32 rounding)."""
    if dim & (dim - 1):
        return None
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / dim**0.5


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` -> int8 `[..., D + 4]`: the rotated, rounded values, then the row's
    float32 scale."""
    x = x.float()
    if (h := hadamard(x.shape[-1], x.device)) is not None:
        x = x @ h
    scale = x.abs().amax(-1, keepdim=True) / INT8_MAX
    # A zero row keeps scale 0; dividing by the smallest normal instead gives its zeros.
    values = (x / scale.clamp_min(torch.finfo(torch.float32).tiny)).round_()
    values = values.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows `[..., D + 4]` back to `[..., D]` in `dtype` (multiplied in float32)."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    x = rows[..., :-INT8_SCALE_BYTES].float() * scale
    if (h := hadamard(x.shape[-1], x.device)) is not None:
        x = x @ h
    return x.to(dtype)
