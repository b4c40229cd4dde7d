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

from workers.kernels.paged_decode import PagedDecode
from workers.kernels.split_kv_common import LOG2E, heads_fit

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


class FP8Decode(PagedDecode):
    """The kernel for decode steps of exactly `batch_size` rows (`PagedDecode`)."""

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor, last_page_len: torch.Tensor, k_scale: float, v_scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """q `[B, Hq, D]` (rotated); `kv` one layer's FP8 pool `[pages, 2, page_size, Hkv, D]`
        holding every token attended to, the new ones included, as `stored = x / scale`; the
        page table in FlashInfer's CSR form (device tensors). Returns `[B, Hq, D]` in q's
        dtype."""
        assert kv.dtype in _FP8 and kv.shape[-1] == self.head_dim
        table = (kv_indptr, kv_indices, last_page_len)
        scales = (self.scale * k_scale * LOG2E, v_scale)
        return self.run(q, (kv, kv), kv, table, scales)
