"""The inputs of a decode forward whose norms run inside its GEMMs, in one kernel (Triton).

`LlamaForCausalLM._forward_folded` starts from the embedding rows, the float64 sums of their
squares (the first layer's input norm, read by its q/k/v GEMV), a zeroed buffer of sums for
the later residual streams (`skinny_tiles.finish` adds into it) and rotary's cos/sin. As a
gather, a memset, a norm kernel and `rope.cos_sin` they took 8.7 µs of a batch-1 step on an
H200 before the first layer; in this one launch 3.2 (docs/notes/decode-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.rope import cos_sin_row
from workers.kernels.skinny_tiles import SUMSQ_SLOTS


@triton.jit
def _step_inputs_kernel(
    ids_ptr, w_ptr, out_ptr, sums_ptr, dim, w_stride, num_sums, pos_ptr, inv_freq_ptr, cos_ptr,
    sin_ptr, half, BLOCK: tl.constexpr, SLOTS: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    m = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    freq_cols = tl.arange(0, HALF_BLOCK)
    inv_freq = tl.load(inv_freq_ptr + freq_cols, mask=freq_cols < half, other=0.0)
    wait_for_inputs(PDL)
    row = tl.load(w_ptr + tl.load(ids_ptr + m).to(tl.int64) * w_stride + cols, mask=mask, other=0)
    tl.store(out_ptr + m * dim + cols, row, mask=mask)
    x = row.to(tl.float64)
    total = tl.sum(x * x, axis=0)  # exact: float64 squares of 16-bit values (skinny_tiles.finish)
    slots = tl.arange(0, SLOTS)
    tl.store(sums_ptr + m * SLOTS + slots, tl.where(slots == 0, total, 0.0))
    for i in range(1, num_sums):
        tl.store(sums_ptr + (i * rows + m) * SLOTS + slots, tl.zeros([SLOTS], tl.float64))
    cos_sin_row(pos_ptr, inv_freq, cos_ptr, sin_ptr, m, half, freq_cols)


def step_inputs(
    ids: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, inv_freq: torch.Tensor,
    num_sums: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """What a forward with the norms inside its GEMMs (`LlamaForCausalLM._forward_folded`)
    starts from, in one kernel instead of a gather, a memset, a norm and `cos_sin`: the
    embedding rows of `ids` `[T]` (`weight` `[V, D]`); a float64
    `[num_sums, T, skinny_tiles.SUMSQ_SLOTS]` buffer of sums of squares of the residual
    streams, whose entry 0 holds the embedding rows' (the first layer's input norm reads it)
    and the rest zeros for the GEMMs to add into; and `cos_sin(positions, inv_freq)`."""
    rows, dim = ids.shape[0], weight.shape[1]
    assert weight.stride(1) == 1 and num_sums >= 1 and positions.shape == ids.shape
    out = torch.empty((rows, dim), dtype=weight.dtype, device=weight.device)
    sums = torch.empty((num_sums, rows, SUMSQ_SLOTS), dtype=torch.float64, device=weight.device)
    half = inv_freq.shape[0]
    cos, sin = (torch.empty((rows, 1, 2 * half), dtype=weight.dtype, device=weight.device)
                for _ in range(2))  # fmt: skip
    if rows:
        _step_inputs_kernel[(rows,)](
            ids, weight, out, sums, dim, weight.stride(0), num_sums, positions, inv_freq, cos,
            sin, half, BLOCK=triton.next_power_of_2(dim), SLOTS=SUMSQ_SLOTS,
            HALF_BLOCK=triton.next_power_of_2(half), num_warps=4, **pdl.launch_options(out),
        )  # fmt: skip
    return out, sums, (cos, sin)
