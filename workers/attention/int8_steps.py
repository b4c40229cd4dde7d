"""An int8 KV pool (rows with their own scales, `kvcache/int8_rows.py`) on the flashinfer
backend, which has no FlashInfer kernel for it: decode rows are read by the Triton kernel
(`kernels/int8_decode.py`), q rotated by the rows' Hadamard matrix before and the output after;
prefill rows attend through FlashInfer's prefill over a dequantized copy of the pages they read.
The rows are written by `rope_int8.rotary_store_int8` (`flashinfer.py`'s `forward_rotary`)."""

from __future__ import annotations

from typing import Any

import flashinfer
import numpy as np
import torch

from workers.attention.base import AttentionBatch
from workers.attention.paged_metadata import PagedMetadata, paged_metadata
from workers.attention.replan_gate import ReplanGate
from workers.kernels import int8_decode
from workers.kernels.int8_decode import Int8Decode
from workers.kvcache.int8_rows import dequantize_rows, hadamard
from workers.kvcache.pool import KVPool


class Int8Rotations:
    """The Hadamard matrices of an int8 pool's rows, built once (not in a capture): H of
    head_dim for q and the output, H of head_dim / 2 for the writes."""

    def __init__(self, pool: KVPool, num_q_heads: int) -> None:
        layout = pool.layout
        if not int8_decode.applies(num_q_heads, layout.num_kv_heads, layout.head_dim, torch.int8):
            raise ValueError(
                "kv_cache_dtype=int8 on the flashinfer backend needs a power-of-2 head_dim "
                "of 32 or more and at most 16 query heads per KV head; use "
                "attention_backend='torch'"
            )
        h = hadamard(layout.head_dim, pool.pages.device)
        half = hadamard(layout.head_dim // 2, pool.pages.device)
        assert h is not None and half is not None  # powers of 2
        self.full, self.half = h, half.contiguous()

    def decode(
        self, kernel: Int8Decode, kv: torch.Tensor, q: torch.Tensor, kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor, last_page_len: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Decode over one layer's int8 pool `kv`: q rotated by H in float32 (the kernel casts
        it to fp16, finer than q's bf16), and the kernel's float32 output rotated back."""
        table = (kv_indptr, kv_indices, last_page_len)
        return self.decode_rotated(kernel, kv, q.float() @ self.full, table, q.dtype)

    def decode_rotated(
        self, kernel: Int8Decode, kv: torch.Tensor, q_by_h: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """`decode` of q already rotated by H in float32 (`rope_int8.rotary_store_int8`'s
        `rotate_q_by_h`); the output in `dtype`."""
        return (kernel.forward(q_by_h, kv, *table) @ self.full).to(dtype)


class Int8Steps:
    """`FlashInferAttention`'s plan and attention for any step over an int8 pool. A mixed step
    splits its rows, so that the decode rows' long contexts are read by the kernel, not
    copied."""

    def __init__(
        self, pool: KVPool, rotations: Int8Rotations, heads: tuple[int, int, int, int],
        scale: float, prefill: flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        plans: ReplanGate, plan_dtypes: dict[str, Any],
    ) -> None:  # fmt: skip
        self.pool, self.rotations, self.heads, self.scale = pool, rotations, heads, scale
        self.prefill, self.plans, self.plan_dtypes = prefill, plans, plan_dtypes
        # Per step: the decode rows' kernel (rebuilt when their count changes) and page table,
        # the pages the prefill rows read (CSR order), and which of the step's rows are which
        # (None: all rows are of one kind; `pages is None`: all decode rows).
        self.kernel: Int8Decode | None = None
        self.table: tuple[torch.Tensor, ...] = ()
        self.pages: torch.Tensor | None = None
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, batch: AttentionBatch, meta: PagedMetadata) -> None:
        """Decode rows: the kernel. Prefill rows: FlashInfer's prefill over a dequantized copy
        of the pages they read, numbered 0.. in CSR order (a page two sequences share is
        copied twice)."""
        self.rows = self.pages = None
        decode = [i for i, q in enumerate(batch.q_lens) if q == 1]
        if len(decode) == len(batch.q_lens):
            self._plan_decode(len(decode), meta)
            return
        if not decode:
            self._plan_prefill(meta)
            return
        prefill = [i for i, q in enumerate(batch.q_lens) if q > 1]
        page_size = self.pool.page_size
        self._plan_decode(len(decode), paged_metadata(_part(batch, decode), page_size))
        self._plan_prefill(paged_metadata(_part(batch, prefill), page_size))
        starts = np.cumsum([0, *batch.q_lens])
        rows = [np.concatenate([np.arange(starts[i], starts[i + 1]) for i in seqs])
                for seqs in (decode, prefill)]  # fmt: skip
        device = self.pool.pages.device
        self.rows = (torch.from_numpy(rows[0]).to(device, non_blocking=True),
                     torch.from_numpy(rows[1]).to(device, non_blocking=True))  # fmt: skip

    def _plan_decode(self, rows: int, meta: PagedMetadata) -> None:
        device = self.pool.pages.device
        if self.kernel is None or self.kernel.batch_size != rows:
            self.kernel = Int8Decode(rows, *self.heads[:3], self.scale, device)
        self.table = (
            meta.kv_indptr.to(device, non_blocking=True), meta.kv_indices,
            meta.last_page_len.to(device, non_blocking=True),
        )  # fmt: skip

    def _plan_prefill(self, meta: PagedMetadata) -> None:
        self.pages = meta.kv_indices.long()
        copies = torch.arange(meta.kv_indices.numel(), dtype=torch.int32,
                              device=self.pool.pages.device)  # fmt: skip
        self.plans.plan(
            self.prefill, meta.qo_indptr, meta.kv_indptr, copies, meta.last_page_len,
            *self.heads, causal=True, sm_scale=self.scale, **self.plan_dtypes,
        )  # fmt: skip

    def run(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """The step's attention output for q's rows (rotated by the rotary embedding)."""
        if self.rows is not None:
            decode_rows, prefill_rows = self.rows
            out = torch.empty_like(q)
            out[decode_rows] = self._decode_rows(layer_id, q[decode_rows])
            out[prefill_rows] = self._prefill_rows(layer_id, q[prefill_rows])
            return out
        if self.pages is None:
            return self._decode_rows(layer_id, q)
        return self._prefill_rows(layer_id, q)

    def _decode_rows(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None, "plan() first"
        return self.rotations.decode(self.kernel, self.pool.layer(layer_id), q, *self.table)

    def _prefill_rows(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        assert self.pages is not None, "plan() first"
        pages = self.pool.layer(layer_id).index_select(0, self.pages)
        return self.prefill.run(q, dequantize_rows(pages, q.dtype))


def _part(batch: AttentionBatch, seqs: list[int]) -> AttentionBatch:
    """`batch`'s sequences `seqs` for planning (their pages and lengths; no slots: the step's
    K/V are written for all its rows at once)."""
    table = batch.page_table[torch.tensor(seqs, device=batch.page_table.device)]
    none = batch.slot_pages[:0]
    return AttentionBatch([batch.q_lens[i] for i in seqs], [batch.kv_lens[i] for i in seqs],
                          table, none, none)  # fmt: skip
