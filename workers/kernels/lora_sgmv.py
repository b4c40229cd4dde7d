"""LoRA products of a decode-sized batch in two Triton launches per projection (Punica's SGMV
shrink and expand), each token reading only its own slot's A and B.

The masked dense products (`lora_ops.add_lora`'s torch path) read every slot's A and B and
take 3-5 launches per projection: at 16-64 tokens those launches, not the bytes, set the time.
Here:

1. `_shrink_kernel`, a program per (token, K split): the token's rows times its slot's A,
   `[parts x rank]` float32 partial sums per split. Splitting the input dimension keeps enough
   programs in flight to read A at the memory's rate with few tokens.
2. `_expand_kernel`, a program per (token, output block): the splits' sums, then each output
   column's part's rank slice times the column's row of B, added into y in place.

A token's slot is read from the step's one-hot mask row (a zero row: the base model alone, and
the token's programs load and store nothing), so the inputs are those of the torch path and
capture in a CUDA graph the same way. The shrunk rows stay float32 between the launches. Both
launch with PDL (`workers/kernels/pdl.py`): the expand's B tile loads while the shrink ends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.skinny_tiles import SUMSQ_SLOTS

MAX_TOKENS = 64  # above this, the masked dense products (tensor-core GEMMs) are faster
MAX_PARTS = 3  # q/k/v
_SUMSQ_SLOTS = tl.constexpr(SUMSQ_SLOTS)
# Launch choices (`bench/bench_lora_products.py --sweep`, an H100, Llama-3-8B projections):
# 256 input columns a shrink program (twice the programs of 512: at 16 tokens q/k/v's shrink
# had 128 programs of four dependent tile loads), one warp an expand program, 64 output columns
# a program up to 16 tokens and 128 above; the four projections then took 0.81x the earlier
# launches' time at 16 tokens, 0.84x at 64 (`lora-products_h100_2026-12-06.json`).
SPLIT_K = 256  # input columns per shrink program
BLOCK_K = 128
EXPAND_WARPS = 1


def block_n_for(tokens: int) -> int:
    """Output columns per expand program."""
    return 64 if tokens <= 16 else 128


@triton.jit
def _token_slot(mask_ptr, t, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr):
    """Token t's slot, and 1 where it has one (0: a base token), from its one-hot mask row."""
    s = tl.arange(0, SLOTS_PAD)
    onehot = tl.load(mask_ptr + t * SLOTS + s, mask=s < SLOTS, other=0.0).to(tl.float32)
    return tl.sum(onehot * s, axis=0).to(tl.int32), tl.sum(onehot, axis=0).to(tl.int32)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, mask_ptr, part_ptr, tokens, n_in, stride_x,
    SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, PR: tl.constexpr, PR_PAD: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    t, split = tl.program_id(0), tl.program_id(1)
    slot, live = _token_slot(mask_ptr, t, SLOTS, SLOTS_PAD)  # the mask: filled before the forward
    wait_for_inputs(PDL)
    rows = tl.arange(0, PR_PAD)
    a_rows = a_ptr + slot.to(tl.int64) * PR * n_in + rows[:, None] * n_in
    acc = tl.zeros((PR_PAD,), dtype=tl.float32)
    k_end = n_in * live  # a base token reads nothing
    for k0 in range(split * SPLIT, split * SPLIT + SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        use = k < k_end
        x = tl.load(x_ptr + t * stride_x + k, mask=use, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=(rows[:, None] < PR) & use[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(part_ptr + (split * tokens + t) * PR + rows, acc, mask=rows < PR * live)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, mask_ptr, part_ptr, ss_ptr, tokens, n_in, eps, n_out, splits, stride_y, end0,
    end1, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    PARTS: tl.constexpr, NORM_IN: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    t, block = tl.program_id(0), tl.program_id(1)
    slot, live = _token_slot(mask_ptr, t, SLOTS, SLOTS_PAD)
    j = tl.arange(0, R_PAD)
    use_j = j < R * live
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    use_n = n < n_out * live
    # B, a weight, streams in while the shrink still runs (PDL)
    b = tl.load(
        b_ptr + n[:, None] * (SLOTS * R) + slot * R + j[None, :],
        mask=use_n[:, None] & use_j[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    wait_for_inputs(PDL)
    s0 = tl.zeros((R_PAD,), dtype=tl.float32)
    s1 = tl.zeros((R_PAD,), dtype=tl.float32)
    s2 = tl.zeros((R_PAD,), dtype=tl.float32)
    for split in range(splits):
        row = part_ptr + (split * tokens + t) * PARTS * R
        s0 += tl.load(row + j, mask=use_j, other=0.0)
        if PARTS > 1:
            s1 += tl.load(row + R + j, mask=use_j, other=0.0)
        if PARTS > 2:
            s2 += tl.load(row + 2 * R + j, mask=use_j, other=0.0)
    if NORM_IN:  # x was the raw stream: 1/rms of its row from the sums (`skinny_tiles`)
        sums = tl.load(ss_ptr + t * _SUMSQ_SLOTS + tl.arange(0, _SUMSQ_SLOTS))
        inv_rms = tl.rsqrt((tl.sum(sums, axis=0) / n_in).to(tl.float32) + eps)
        s0, s1, s2 = s0 * inv_rms, s1 * inv_rms, s2 * inv_rms
    s = tl.broadcast_to(s0[None, :], (BLOCK_N, R_PAD))
    if PARTS > 1:  # each column takes its part's rank slice
        s = tl.where((n >= end0)[:, None], s1[None, :], s)
    if PARTS > 2:
        s = tl.where((n >= end1)[:, None], s2[None, :], s)
    added = tl.sum(b * s, axis=1)
    y = tl.load(y_ptr + t * stride_y + n, mask=use_n, other=0.0)
    tl.store(y_ptr + t * stride_y + n, (y.to(tl.float32) + added).to(y.dtype), mask=use_n)


def sgmv_add_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
    out_parts: list[int], sumsq: torch.Tensor | None = None, eps: float = 0.0,
    split_k: int = SPLIT_K, block_k: int = BLOCK_K, block_n: int | None = None,
    warps: tuple[int, int] = (4, EXPAND_WARPS),
) -> torch.Tensor:  # fmt: skip
    """`lora_ops.add_lora`'s contract (y [T, out] += each token's slot's products, in place)
    in two launches. `x` and `y` rows contiguous; at most `MAX_PARTS` parts; `sumsq`
    [T, SUMSQ_SLOTS] float64 where given. `split_k` .. `warps` (shrink's, expand's): launch
    choices other than the defaults (a sweep's)."""
    tokens, n_in = x.shape
    block_n = block_n or block_n_for(tokens)
    slots, stacked, _ = a.shape
    rank, parts = b.shape[-1], len(out_parts)
    assert stacked == parts * rank and parts <= MAX_PARTS and x.stride(1) == y.stride(1) == 1
    if sumsq is not None and (sumsq.shape != (tokens, SUMSQ_SLOTS) or sumsq.dtype != torch.float64):
        raise ValueError(f"sumsq must be float64 [{tokens}, {SUMSQ_SLOTS}], not {sumsq.shape}")
    splits = triton.cdiv(n_in, split_k)
    partial = torch.empty((splits, tokens, stacked), dtype=torch.float32, device=x.device)
    slots_pad = triton.next_power_of_2(slots)
    launch = pdl.launch_options(x)
    _shrink_kernel[(tokens, splits)](
        x, a, mask, partial, tokens, n_in, x.stride(0), SLOTS=slots, SLOTS_PAD=slots_pad,
        PR=stacked, PR_PAD=triton.next_power_of_2(stacked), SPLIT=split_k, BLOCK_K=block_k,
        num_warps=warps[0], **launch,
    )  # fmt: skip
    ends = [sum(out_parts[: i + 1]) for i in range(parts)] + [0, 0]
    _expand_kernel[(tokens, triton.cdiv(y.shape[1], block_n))](
        y, b, mask, partial, partial if sumsq is None else sumsq, tokens, n_in, eps, y.shape[1],
        splits, y.stride(0), ends[0], ends[1], SLOTS=slots, SLOTS_PAD=slots_pad, R=rank,
        R_PAD=triton.next_power_of_2(rank), PARTS=parts, NORM_IN=sumsq is not None,
        BLOCK_N=block_n, num_warps=warps[1], **launch,
    )  # fmt: skip
    return y
