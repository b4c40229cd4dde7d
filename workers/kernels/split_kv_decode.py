"""Decode attention for small batches in one Triton kernel: rotary, K/V write, split-KV, merge.

At batch 1 a Llama-3-8B layer's attention reads 4 MB of KV (1 µs at the HBM rate) but took
~12 µs after the q/k/v GEMM on an H200 as three dependent kernels (`rope.rotary_store`,
FlashInfer's split-KV decode, its merge of the splits; docs/notes/attention.md), the weight
stream idle. Here one launch does all of it, and starts reading before its input exists:
- programs are (sequence, KV head, split of the sequence's past tokens); each first loads the page
  ids and the K/V of its first tile: tokens of earlier steps, which no kernel of this forward
  writes, so under programmatic dependent launch (`workers/kernels/pdl.py`) they stream while the
  q/k/v GEMM ends. Then it waits for that GEMM's output;
- it rotates its query heads (the KV head's GQA group, as tensor-core rows) and the new token's
  k, with `qk_norm` (Qwen3) after their per-head RMSNorms (`rope_rows.head_rms_norm`: the model
  launches no norm kernels for them); split 0 writes the new k and v into their pool slot and
  counts the new token in its softmax (online, base 2), so no other program reads that slot;
- each split hands in its output and log-sum-exp, and the splits merge them in the same
  launch (`split_kv_common.py`, shared with the FP8 kernel `fp8_decode.py`).
Arithmetic as FlashInfer's: bf16 q, K and probabilities into fp32 tensor-core products.

One launch cannot see writes of its own other programs, so a step whose rows include several
tokens of one sequence (a prefill chunk laid out one row per token) must not use it: each row's
past would include the K/V other rows write in the same launch. `engine/cuda_graph.py` never
runs such a step on a graph that uses this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.norms import QKNorm, qk_norm_args
from workers.kernels.pdl import wait_for_inputs
from workers.kernels.rope_rows import head_rms_norm
from workers.kernels.split_kv_common import (
    LOG2E,
    SplitParts,
    attend,
    finish_split,
    group_queries,
    heads_fit,
    num_splits,
    sequence_pages,
    tile_kv,
)

MAX_BATCH = 1  # batch sizes whose decode graphs use this kernel (FlashInfer above)
TILE = 32  # past tokens per inner step
NUM_WARPS = 4


def applies(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these heads (`heads_fit`) and pool (16-bit)."""
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    return sixteen_bit and heads_fit(num_q_heads, num_kv_heads, head_dim)


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_ptr, v_ptr, q_st, q_sh, k_st, k_sh, v_st, v_sh, cos_ptr, sin_ptr, cs_st,
    kv_ptr, s_page, s_kv, s_slot, s_head, indptr_ptr, idx_ptr, last_ptr, slot_page_ptr,
    slot_off_ptr, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, scale_log2, qn_ptr, kn_ptr, eps,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, PS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, ALL_MERGE: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    p0, kv_len = sequence_pages(indptr_ptr, last_ptr, b, PS)
    past = kv_len - 1  # tokens in the pool before this step; the new one is kv_len - 1
    chunk = tl.cdiv(past, SPLITS)
    start = split * chunk
    end = tl.minimum(start + chunk, past)
    # Before the input is ready (PDL): page ids and K/V of the first tile of the past.
    t = start + tl.arange(0, TILE)
    k1, k2, v, mask = tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
                               PS, HALF)  # fmt: skip
    wait_for_inputs(PDL)
    # The group's query heads as rows (padded to the 16 a tensor-core product needs), normed
    # (QK_NORM), rotated.
    dh = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + b * cs_st + dh).to(tl.float32)  # first half == second half
    sin = tl.load(sin_ptr + b * cs_st + dh).to(tl.float32)
    x1, x2 = group_queries(q_ptr, q_st, q_sh, b, h, GROUP, HALF)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, qn_ptr, eps, HALF, q_ptr.dtype.element_ty)
    q1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(v.dtype)
    q2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(v.dtype)
    # The new token: k (normed), rotated; split 0 writes k and v to the pool and starts its
    # softmax there.
    k_row = k_ptr + b * k_st + h * k_sh
    y1 = tl.load(k_row + dh).to(tl.float32)
    y2 = tl.load(k_row + HALF + dh).to(tl.float32)
    if QK_NORM:
        y1, y2 = head_rms_norm(y1, y2, kn_ptr, eps, HALF, k_ptr.dtype.element_ty)
    kn1 = (y1 * cos - y2 * sin).to(v.dtype)
    kn2 = (y2 * cos + y1 * sin).to(v.dtype)
    dd = tl.arange(0, 2 * HALF)
    vn = tl.load(v_ptr + b * v_st + h * v_sh + dd).to(v.dtype)
    first = split == 0
    slot = (
        kv_ptr + tl.load(slot_page_ptr + b).to(tl.int64) * s_page
        + tl.load(slot_off_ptr + b).to(tl.int64) * s_slot + h * s_head
    )  # fmt: skip
    # Split 0 only, as a mask of the stored vector's shape: a bound, all or nothing (Triton's
    # interpreter gives `first & (dh < HALF)` an integer type, which no store takes).
    bound = tl.where(first, HALF, 0)
    tl.store(slot + dh, kn1, mask=dh < bound)
    tl.store(slot + HALF + dh, kn2, mask=dh < bound)
    tl.store(slot + s_kv + dd, vn, mask=dd < 2 * bound)
    s_new = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], axis=1)
    s_new += tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], axis=1)
    top = tl.where(first, s_new * scale_log2, -1.0e30)
    denom = tl.where(first, 1.0, 0.0) + tl.zeros([16], dtype=tl.float32)
    acc = tl.where(first, 1.0, 0.0) * vn.to(tl.float32)[None, :] + tl.zeros(
        [16, 2 * HALF], dtype=tl.float32
    )
    top, denom, acc = attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2)
    for t0 in range(start + TILE, end, TILE):
        t = t0 + tl.arange(0, TILE)
        k1, k2, v, mask = tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
                                   PS, HALF)  # fmt: skip
        top, denom, acc = attend(q1, q2, k1, k2, v, mask, top, denom, acc, scale_log2)
    finish_split(acc, top, denom, 1.0, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h, split,
                 num_kv_heads, GROUP, GROUP_P2, HALF, SPLITS, ALL_MERGE, PDL)  # fmt: skip


class SplitKVDecode:
    """The kernel's fixed buffers for decode steps of exactly `batch_size` rows; `forward`
    calls may be captured in a CUDA graph (nothing allocated but the output)."""

    def __init__(
        self, batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.batch_size = batch_size
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale_log2 = scale * LOG2E
        splits = num_splits(batch_size, num_kv_heads)
        self.parts = SplitParts(batch_size, num_kv_heads, self.group, head_dim, splits, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
        last_page_len: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q `[B, Hq, D]`, k/v `[B, Hkv, D]` of the new tokens before rotation (`cos`/`sin`
        `[B, 1, D]`) and before their per-head RMSNorms where `qk_norm` is given; `kv` one
        layer's pool `[pages, 2, page_size, Hkv, D]`; the page table in FlashInfer's CSR form
        (device tensors). Returns the attention output `[B, Hq, D]`."""
        b, hq, d = q.shape
        assert b == self.batch_size and d == self.head_dim  # the split buffers' sizes
        assert k.shape == v.shape == (b, self.num_kv_heads, d)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kv.stride(-1) == 1
        assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and q.dtype == kv.dtype
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
        parts = self.parts
        grid = (b, self.num_kv_heads, parts.splits)
        args = (
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos, sin, cos.stride(0), kv, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            kv_indptr, kv_indices, last_page_len, slot_pages, slot_offsets, parts.part_o,
            parts.part_lse, parts.locks, out, self.scale_log2, *qk_norm_args(qk_norm, q),
        )  # fmt: skip
        options = dict(
            GROUP=self.group, GROUP_P2=parts.group_p2, HALF=d // 2, PS=kv.shape[2], TILE=TILE,
            SPLITS=parts.splits, QK_NORM=qk_norm is not None, num_warps=NUM_WARPS,
            **pdl.launch_options(q),
        )  # fmt: skip
        parts.launch(_split_kv_decode_kernel, grid, args, options, q)
        return out
