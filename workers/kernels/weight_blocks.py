"""Weights stored in blocks of rows, for the skinny GEMM's weight stream (imports no Triton).

A blocked [N, K] weight holds N / block blocks of `block` consecutive rows, each stored
transposed ([K, block]: the block's rows side by side). A skinny GEMM program that reads a tile
of those rows then reads one contiguous run of memory each K step instead of one short run per
row (BLOCK_K values, 128 bytes at block_k 64), and HBM serves long runs closer to its copy rate:
on an H200, gate_up at 64 rows streamed 11% faster so (docs/notes/fp8-kv.md). The tensor keeps
its shape and dtype; `rows_per_block` tells the layout, the skinny GEMM kernels address either
(`skinny_tiles.program_tiles`), and `blocked_linear` is `F.linear` for a blocked weight, one
strided-batched GEMM (a block's rows are a [K, block] matrix, its outputs a column range).
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 128
_LAYOUT = "rows_per_block"  # an attribute of the blocked tensor (a Parameter keeps it)


def rows_per_block(weight: torch.Tensor) -> int:
    """The rows of a block of `weight` (`block_rows`), 1 for a row-major weight."""
    return getattr(weight, _LAYOUT, 1)


def block_rows(weight: torch.nn.Parameter, block: int = BLOCK_ROWS) -> None:
    """Store the row-major [N, K] `weight` in blocks of `block` rows, in place (the old storage
    is freed once the new one is written: one weight's bytes more for a moment)."""
    n, k = weight.shape
    if n % block or rows_per_block(weight) != 1 or not weight.is_contiguous():
        raise ValueError(f"a row-major weight of rows divisible by {block}, not {weight.shape}")
    weight.data = weight.data.view(n // block, block, k).transpose(1, 2).contiguous().view(n, k)
    setattr(weight, _LAYOUT, block)


def blocked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a blocked `weight`: block b's rows give output columns
    [b * block, (b + 1) * block), written in place by a batched GEMM over the blocks."""
    block = rows_per_block(weight)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    blocks = out.view(m, n // block, block).transpose(0, 1)
    torch.bmm(rows.expand(n // block, m, k), weight.view(n // block, k, block), out=blocks)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)
