"""Decode attention over an FP8 (e4m3) paged KV pool, in one Triton launch.

FlashInfer's decode for FP8 pages (its FA2 mixed-precision kernels: bf16 queries, dequantizing
in the kernel) read them on an H200 at ~2 TB/s, well under the copy rate: a Llama-3-8B step at
64 x 4096 took 1.58x its floor with FP8 KV against 1.10x with bf16 KV (docs/notes/fp8-kv.md).
Here:
- programs are (sequence, KV head, split of the sequence's tokens), the splits from batch x KV
  heads (`split_kv_common.num_splits`, for the launch table's number of programs); the KV
  head's GQA group of query heads are the rows of a tensor-core product (padded to 16);
- each tile of tokens is loaded as FP8 and cast to fp16 in registers (exact: every e4m3 value
  is an fp16 one; the probabilities keep 3 more bits than bf16's), the loads software-pipelined
  over `STAGES` tiles;
- the layer's K scale is folded into the softmax scale and its V scale into the output; online
  softmax in base 2; the splits' outputs are merged in the same launch (`split_kv_common`).
The new token's K/V is written before, by the quantizing `rope.rotary_store`, and read back from
the pool like the others: the kernel waits for its inputs (PDL) before its first K/V load, so
rows that are tokens of one sequence (a prefill chunk on a decode graph) see each other's K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import wait_for_inputs
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
from workers.kernels.tuning import FP8DecodeLaunch, fp8_decode_launch

# Launch choices per batch size and GPU model: data (`tuning.fp8_decode_launch`,
# tables/fp8_decode_<GPU>.json), the fastest of `bench/bench_fp8_decode.py --attention
# --sweep` (docs/notes/fp8-kv.md). On an H200: 128 tokens a tile and 4 warps at batch 1;
# from 16 sequences up 64 tokens a tile and ONE warp a program (no cross-warp reductions or
# layout exchanges through shared memory per tile, and 12 KiB of it a program, so many
# programs a multiprocessor hide each other's arithmetic): 0.76-0.90x the 4-warp time.
_FP8 = (torch.float8_e4m3fn,)  # the pools' FP8 (`kvcache/kv_dtype.py`)
# Decode-graph batch sizes at which FlashInfer's FP8 decode was measured the faster (the
# attention alone, `--attention` as above): those graphs keep it. Empty: at 1, 16, 64 and 256
# sequences this kernel took 0.56, 0.78, 0.85 and 0.83-0.86x FlashInfer's time.
FLASHINFER_FASTER: frozenset[int] = frozenset()


def used_at(batch_size: int) -> bool:
    """Whether a decode graph of `batch_size` rows reads an FP8 pool with this kernel."""
    return batch_size not in FLASHINFER_FASTER


def applies(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these heads (`heads_fit`) and pool (FP8)."""
    return dtype in _FP8 and heads_fit(num_q_heads, num_kv_heads, head_dim)


@triton.jit
def _fp8_decode_kernel(
    q_ptr, q_st, q_sh, kv_ptr, s_page, s_kv, s_slot, s_head, indptr_ptr, idx_ptr, last_ptr,
    part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, scale_log2, v_scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr, PS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr, ALL_MERGE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    p0, kv_len = sequence_pages(indptr_ptr, last_ptr, b, PS)
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), TILE) * TILE  # whole tiles, but for the last
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    wait_for_inputs(PDL)  # q, and the new token's K/V in the pool
    q1, q2 = group_queries(q_ptr, q_st, q_sh, b, h, GROUP, HALF)
    q1, q2 = q1.to(tl.float16), q2.to(tl.float16)
    top = tl.full([16], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([16], dtype=tl.float32)
    acc = tl.zeros([16, 2 * HALF], dtype=tl.float32)
    for t0 in tl.range(start, end, TILE, num_stages=STAGES):
        t = t0 + tl.arange(0, TILE)
        k1, k2, v, mask = tile_kv(kv_ptr, idx_ptr, p0, t, end, h, s_page, s_kv, s_slot, s_head,
                                  PS, HALF)  # fmt: skip
        top, denom, acc = attend(q1, q2, k1.to(tl.float16), k2.to(tl.float16),
                                 v.to(tl.float16), mask, top, denom, acc, scale_log2)  # fmt: skip
    finish_split(acc, top, denom, v_scale, part_o_ptr, part_lse_ptr, lock_ptr, out_ptr, b, h,
                 split, num_kv_heads, GROUP, GROUP_P2, HALF, SPLITS, ALL_MERGE, PDL)  # fmt: skip


class FP8Decode:
    """The kernel's fixed buffers for decode steps of exactly `batch_size` rows; `forward`
    calls may be captured in a CUDA graph (nothing allocated but the output)."""

    def __init__(
        self, batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        device: torch.device, launch: FP8DecodeLaunch | None = None, splits: int | None = None,
    ) -> None:  # fmt: skip
        """`launch`, `splits`: choices other than the GPU's table (a sweep's, a test's); the
        splits by default for about `launch.programs` programs (`num_splits`)."""
        self.batch_size = batch_size
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        if launch is None:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
            launch = fp8_decode_launch(batch_size, gpu)
        self.launch = dict(TILE=launch.tile, STAGES=launch.stages, num_warps=launch.num_warps)
        splits = splits or num_splits(batch_size, num_kv_heads, launch.programs)
        self.parts = SplitParts(batch_size, num_kv_heads, self.group, head_dim, splits, device)

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor, last_page_len: torch.Tensor, k_scale: float, v_scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """q `[B, Hq, D]` (rotated); `kv` one layer's FP8 pool `[pages, 2, page_size, Hkv, D]`
        holding every token attended to, the new ones included, as `stored = x / scale`; the
        page table in FlashInfer's CSR form (device tensors). Returns `[B, Hq, D]` in q's
        dtype."""
        b, hq, d = q.shape
        assert b == self.batch_size and d == self.head_dim  # the split buffers' sizes
        assert hq == self.num_kv_heads * self.group and kv.shape[-2:] == (self.num_kv_heads, d)
        assert q.stride(-1) == kv.stride(-1) == 1 and kv.dtype in _FP8
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
        parts = self.parts
        grid = (b, self.num_kv_heads, parts.splits)
        args = (
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), kv.stride(2),
            kv.stride(3), kv_indptr, kv_indices, last_page_len, parts.part_o, parts.part_lse,
            parts.locks, out, self.scale * k_scale * LOG2E, v_scale,
        )  # fmt: skip
        options = dict(
            GROUP=self.group, GROUP_P2=parts.group_p2, HALF=d // 2, PS=kv.shape[2],
            SPLITS=parts.splits, **self.launch, **pdl.launch_options(q),
        )  # fmt: skip
        parts.launch(_fp8_decode_kernel, grid, args, options, q)
        return out
