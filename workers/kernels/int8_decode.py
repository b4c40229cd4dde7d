"""Decode attention over an int8 paged KV pool (rows of `head_dim` signed bytes, then the row's
float32 scale: `kvcache/int8_rows.py`), in one Triton launch.

The FP8 kernel's split-KV structure (`paged_decode.py`: programs (sequence, KV head, split),
the GQA group as the rows of a tensor-core product, splits merged in the launch), with each
row's own scale instead of one per layer:
- each tile's int8 K and V are cast to fp16 in registers (exact: |x| <= 127), the K scales
  multiply the scores per token, after the product;
- V's scales multiply the probabilities per token before the second product, divided by the
  tile's largest V scale (which multiplies the product's result instead), so the fp16
  operand keeps its 10 bits whatever the rows' magnitudes.
The rows are stored rotated by a Hadamard matrix H; the caller rotates q by H before and the
output by H after (H is orthonormal and symmetric: q.k = (qH).(kH), and sum p v = (sum p vH) H),
so no row is rotated here. q may be float32 (then so is the output): it is cast to fp16 here.
"""

from __future__ import annotations

import torch

from workers.kernels.paged_decode import PagedDecode
from workers.kernels.split_kv_common import LOG2E, heads_fit

SCALE_BYTES = 4  # a row's float32 scale, after its head_dim bytes


def applies(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these heads (`heads_fit`) and pool (int8 rows)."""
    return dtype == torch.int8 and heads_fit(num_q_heads, num_kv_heads, head_dim)


class Int8Decode(PagedDecode):
    """The kernel for decode steps of exactly `batch_size` rows (`PagedDecode`; its launch by
    default the GPU table's int8 entry, else the FP8 kernel's)."""

    int8_rows = True

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor, last_page_len: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """q `[B, Hq, D]`, rotated by H; `kv` one layer's int8 pool `[pages, 2, page_size, Hkv,
        D + 4]` holding every token attended to, the new ones included; the page table in
        FlashInfer's CSR form (device tensors). Returns `[B, Hq, D]` in q's dtype, still
        rotated by H."""
        assert kv.dtype == torch.int8 and kv.shape[-1] == self.head_dim + SCALE_BYTES
        table = (kv_indptr, kv_indices, last_page_len)
        pools = (kv, kv.view(torch.float32))
        return self.run(q, pools, kv, table, (self.scale * LOG2E, 1.0))
