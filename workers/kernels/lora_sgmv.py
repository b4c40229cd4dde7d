"""LoRA products of a decode-sized batch in two Triton launches per projection (Punica's SGMV
shrink and expand), each adapter slot's A and B read once for all the tokens that run with it.

The masked dense products (`lora_ops.add_lora`'s torch path) read every slot's A and B and
take 3-5 launches per projection: at 16-64 tokens those launches, not the bytes, set the time.
Here:

1. `_shrink_slot_kernel`, a program per (slot, K split): the slot's tokens' rows times its A
   (a tensor-core product over the batch's rows, the other slots' rows masked off and not
   read), `[parts x rank]` float32 partial sums per token and split.
2. `_expand_slot_kernel`, a program per (slot, output block): its tokens' sums over the
   splits, then each output part's rank slice times the block's rows of the slot's B, added
   into y in place. Each token's rows are written by its slot's programs only.

A program per token instead (each reading its slot's A and B again) took 1.2-1.3x as long at
16 and 64 tokens (docs/notes/lora-kernels.md, "Slot-major kernels"). A token's slot is read from the
step's one-hot mask (a zero row: the base model alone, and no program touches its rows), so
the inputs are those of the torch path and capture in a CUDA graph the same way. The shrunk
rows stay float32 between the launches. Both launch with PDL (`workers/kernels/pdl.py`): the
expand's B tile loads while the shrink ends.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs
from workers.kernels.skinny_tiles import SUMSQ_SLOTS

MAX_TOKENS = 64  # above this, the masked dense products (tensor-core GEMMs) are faster
MAX_PARTS = 3  # q/k/v
_SUMSQ_SLOTS = tl.constexpr(SUMSQ_SLOTS)


def launch_choices(tokens: int, n_in: int, n_out: int) -> tuple[int, int, int, tuple[int, int]]:
    """(input columns a shrink program, its tile, output columns an expand program, (shrink's,
    expand's) warps): the best of a sweep per Llama-3-8B projection on an H100
    (docs/notes/lora-kernels.md, "Slot-major kernels"), as rules. Many
    tokens want longer shrink splits (fewer partial sums for the expand to add); a wide
    output (gate/up) wants narrower expand programs of 4 warps."""
    few, long_in, wide_out = tokens <= 16, n_in > 8192, n_out > 16384
    if few:
        split_k = 512 if long_in else 256
        return split_k, 128 if long_in else 64, 128 if wide_out else 256, (
            4, 4 if wide_out or long_in else 8)  # fmt: skip
    return 1024 if wide_out else 512, 128, 128, (4, 4 if wide_out else 8)


@triton.jit
def _slot_rows(mask_ptr, slot, tokens, SLOTS: tl.constexpr, T_PAD: tl.constexpr):
    """The batch's rows (padded to T_PAD) and whether each runs with `slot`, from the one-hot
    mask's column."""
    t = tl.arange(0, T_PAD)
    mine = tl.load(mask_ptr + t * SLOTS + slot, mask=t < tokens, other=0.0) != 0
    return t, mine


@triton.jit
def _shrink_slot_kernel(
    x_ptr, a_ptr, mask_ptr, part_ptr, tokens, n_in, stride_x,
    SLOTS: tl.constexpr, T_PAD: tl.constexpr, PR: tl.constexpr, PR_PAD: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    slot, split = tl.program_id(0), tl.program_id(1)
    t, mine = _slot_rows(mask_ptr, slot, tokens, SLOTS, T_PAD)  # filled before the forward
    k_end = tl.where(tl.sum(mine.to(tl.int32), axis=0) > 0, n_in, 0)  # none: reads nothing
    rows = tl.arange(0, PR_PAD)
    a_rows = a_ptr + slot.to(tl.int64) * PR * n_in + rows[:, None] * n_in
    k_stop = tl.minimum(k_end, split * SPLIT + SPLIT)
    k = split * SPLIT + tl.arange(0, BLOCK_K)
    # A is a weight: its first tile streams in while the kernel writing x ends
    a = tl.load(a_rows + k[None, :], mask=(rows[:, None] < PR) & (k < k_stop)[None, :], other=0.0)
    wait_for_inputs(PDL)
    acc = tl.zeros((T_PAD, PR_PAD), dtype=tl.float32)
    for k0 in range(split * SPLIT, split * SPLIT + SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        # only the slot's rows are read: masked-off lanes load nothing
        x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :],
                    mask=mine[:, None] & (k < k_end)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc)
        k += BLOCK_K  # the next tile of A (none past the split)
        a = tl.load(a_rows + k[None, :], mask=(rows[:, None] < PR) & (k < k_stop)[None, :],
                    other=0.0)  # fmt: skip
    out = part_ptr + (split * tokens + t[:, None]) * PR + rows[None, :]
    tl.store(out, acc, mask=mine[:, None] & (rows[None, :] < PR))


@triton.jit
def _expand_slot_kernel(
    y_ptr, b_ptr, mask_ptr, part_ptr, ss_ptr, tokens, n_in, eps, n_out, splits, stride_y, end0,
    end1, SLOTS: tl.constexpr, T_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
    PARTS: tl.constexpr, NORM_IN: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    slot, block = tl.program_id(0), tl.program_id(1)
    t, mine = _slot_rows(mask_ptr, slot, tokens, SLOTS, T_PAD)
    n_end = tl.where(tl.sum(mine.to(tl.int32), axis=0) > 0, n_out, 0)  # none: reads nothing
    j = tl.arange(0, R_PAD)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    use_n = n < n_end
    # the slot's B, read once for all its tokens; a weight: it streams in while the shrink runs
    b = tl.load(
        b_ptr + n[:, None] * (SLOTS * R) + slot * R + j[None, :],
        mask=use_n[:, None] & (j[None, :] < R), other=0.0,
    ).to(tl.float32)  # fmt: skip
    bt = tl.trans(b)
    wait_for_inputs(PDL)
    rows = mine[:, None] & (j[None, :] < R)
    s0 = tl.zeros((T_PAD, R_PAD), dtype=tl.float32)
    s1 = tl.zeros((T_PAD, R_PAD), dtype=tl.float32)
    s2 = tl.zeros((T_PAD, R_PAD), dtype=tl.float32)
    for split in range(splits):
        part = part_ptr + (split * tokens + t[:, None]) * PARTS * R + j[None, :]
        s0 += tl.load(part, mask=rows, other=0.0)
        if PARTS > 1:
            s1 += tl.load(part + R, mask=rows, other=0.0)
        if PARTS > 2:
            s2 += tl.load(part + 2 * R, mask=rows, other=0.0)
    if NORM_IN:  # x was the raw stream: 1/rms of its rows from the sums (`skinny_tiles`)
        c = tl.arange(0, _SUMSQ_SLOTS)
        sums = tl.load(ss_ptr + t[:, None] * _SUMSQ_SLOTS + c[None, :], mask=mine[:, None],
                       other=0.0)  # fmt: skip
        inv_rms = tl.rsqrt((tl.sum(sums, axis=1) / n_in).to(tl.float32) + eps)[:, None]
        s0, s1, s2 = s0 * inv_rms, s1 * inv_rms, s2 * inv_rms
    # tf32 products: 10 bits of the shrunk rows' mantissa, below the bf16 output's rounding
    added = tl.dot(s0, bt, input_precision="tf32")
    if PARTS > 1:  # each column takes its part's rank slice
        added = tl.where((n >= end0)[None, :], tl.dot(s1, bt, input_precision="tf32"), added)
    if PARTS > 2:
        added = tl.where((n >= end1)[None, :], tl.dot(s2, bt, input_precision="tf32"), added)
    at = y_ptr + t[:, None] * stride_y + n[None, :]
    keep = mine[:, None] & use_n[None, :]
    y = tl.load(at, mask=keep, other=0.0)
    tl.store(at, (y.to(tl.float32) + added).to(y.dtype), mask=keep)


@dataclasses.dataclass(frozen=True)
class ShrunkRows:
    """A projection's shrunk rows, for the skinny GEMM's epilogue to expand and add into its
    own product (`skinny_linear(lora=...)`) instead of `_expand_slot_kernel` launching after
    it: `partial` [splits, tokens, parts x rank] float32 sums (`shrink`), `mask` [tokens,
    slots] one-hot of each token's slot, `b` [out, slots, rank], and where along the output
    parts 1 and 2 start (`n_out` past the last part)."""

    partial: torch.Tensor
    mask: torch.Tensor
    b: torch.Tensor
    ends: tuple[int, int]


def shrink(
    x: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, n_out: int,
    choices: tuple[int, int, int, tuple[int, int]] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The first launch of `sgmv_add_lora`: each token's rows of x [T, in] (rows contiguous)
    times its slot's A, `[splits, T, parts x rank]` float32 partial sums over the input."""
    tokens, n_in = x.shape
    split_k, block_k, _, warps = choices or launch_choices(tokens, n_in, n_out)
    slots, stacked, _ = a.shape
    assert x.stride(1) == 1
    splits = triton.cdiv(n_in, split_k)
    partial = torch.empty((splits, tokens, stacked), dtype=torch.float32, device=x.device)
    _shrink_slot_kernel[(slots, splits)](
        x, a, mask, partial, tokens, n_in, x.stride(0), SLOTS=slots, T_PAD=_t_pad(tokens),
        PR=stacked, PR_PAD=max(16, triton.next_power_of_2(stacked)), SPLIT=split_k,
        BLOCK_K=block_k, num_warps=warps[0], **pdl.launch_options(x),
    )  # fmt: skip
    return partial


def shrunk_rows(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, out_parts: list[int]
) -> ShrunkRows:
    """`shrink` of x's rows for a GEMM epilogue to finish (`ShrunkRows`)."""
    partial = shrink(x.contiguous(), a, mask, sum(out_parts))
    return ShrunkRows(partial, mask, b, part_ends(out_parts))


def part_ends(out_parts: list[int]) -> tuple[int, int]:
    """Where parts 1 and 2 start along the output; the output's size for parts not there."""
    n_out = sum(out_parts)
    ends = [sum(out_parts[: i + 1]) for i in range(len(out_parts) - 1)] + [n_out, n_out]
    return ends[0], ends[1]


def _t_pad(tokens: int) -> int:
    return max(16, triton.next_power_of_2(tokens))  # tl.dot's smallest M


def sgmv_add_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
    out_parts: list[int], sumsq: torch.Tensor | None = None, eps: float = 0.0,
    choices: tuple[int, int, int, tuple[int, int]] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`lora_ops.add_lora`'s contract (y [T, out] += each token's slot's products, in place)
    in two launches. `x` and `y` rows contiguous; at most `MAX_PARTS` parts; `sumsq`
    [T, SUMSQ_SLOTS] float64 where given. `choices`: launch choices other than
    `launch_choices`' (a sweep's)."""
    tokens, n_in = x.shape
    _, _, block_n, warps = choices or launch_choices(tokens, n_in, y.shape[1])
    rank, parts = b.shape[-1], len(out_parts)
    assert a.shape[1] == parts * rank and parts <= MAX_PARTS and y.stride(1) == 1
    if sumsq is not None and (sumsq.shape != (tokens, SUMSQ_SLOTS) or sumsq.dtype != torch.float64):
        raise ValueError(f"sumsq must be float64 [{tokens}, {SUMSQ_SLOTS}], not {sumsq.shape}")
    partial = shrink(x, a, mask, y.shape[1], choices)
    ends = part_ends(out_parts)
    _expand_slot_kernel[(a.shape[0], triton.cdiv(y.shape[1], block_n))](
        y, b, mask, partial, partial if sumsq is None else sumsq, tokens, n_in, eps,
        y.shape[1], partial.shape[0], y.stride(0), ends[0], ends[1], SLOTS=a.shape[0],
        T_PAD=_t_pad(tokens), R=rank, R_PAD=max(16, triton.next_power_of_2(rank)), PARTS=parts,
        NORM_IN=sumsq is not None, BLOCK_N=block_n, num_warps=warps[1], **pdl.launch_options(x),
    )  # fmt: skip
    return y
