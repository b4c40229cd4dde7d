"""`GraphDecodeAttention`: decode steps of one batch size for the CUDA graphs, from buffers
that never move (`flashinfer.py`'s backends share its base, `PagedFlashInfer`)."""

from __future__ import annotations

import flashinfer
import numpy as np
import torch

from workers.attention import xqa_decode
from workers.attention.base import AttentionBatch
from workers.attention.flashinfer import PagedFlashInfer
from workers.attention.paged_metadata import paged_metadata
from workers.attention.xqa_decode import XQABuffers, XQADecode
from workers.kernels import fp8_decode, rope, split_kv_decode
from workers.kernels.fp8_decode import FP8Decode
from workers.kernels.host_staging import host_array
from workers.kernels.int8_decode import Int8Decode
from workers.kernels.norms import QKNorm
from workers.kernels.rope_int8 import rotary_store_int8
from workers.kernels.split_kv_decode import SplitKVDecode
from workers.kvcache.pool import KVPool


class GraphDecodeAttention(PagedFlashInfer):
    """Decode for exactly `batch_size` sequences, from buffers whose addresses never change.

    Invariants: `plan` copies the step's metadata into the buffers it was built with and never
    reallocates them, so kernels captured in a CUDA graph after a first `plan` read the current
    step's values on replay. `indices_buffer` must hold the step's total page count; padding rows
    attend to one token in scratch page 0 and write their K/V there.

    Up to `split_kv_decode.MAX_BATCH` rows each layer runs one Triton kernel instead of
    FlashInfer's (rotary, K/V write, attention and merge in one launch that starts reading KV
    before its input is ready); such a graph takes decode rows only, one per sequence
    (`accepts_token_rows` is False). An FP8 pool is read by `fp8_decode`'s kernel where
    `fp8_decode.used_at` the batch size (the K/V written before it, as for FlashInfer), an
    int8 pool by `int8_decode`'s at every size.
    """

    def __init__(
        self, pool: KVPool, num_q_heads: int, scale: float, batch_size: int,
        workspace: torch.Tensor, indices_buffer: torch.Tensor, tensor_cores: bool | None = None,
        xqa: XQABuffers | None = None, fp8_kernel: str | None = None,
    ) -> None:  # fmt: skip
        """`xqa`: buffers where XQA serves this pool (`xqa_decode.applies`); `fp8_kernel`:
        `KernelConfig.fp8_decode_kernel`."""
        super().__init__(pool, num_q_heads, scale, tensor_cores)
        device = pool.pages.device
        self.batch_size = batch_size
        self.slot_pages = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.slot_offsets = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._slot_pages, self._slot_offsets = self.slot_pages, self.slot_offsets
        self.kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.kv_indices = indices_buffer
        self.max_pages = indices_buffer.numel()
        _, num_kv_heads, head_dim, _ = self._heads
        self.split_kv: SplitKVDecode | None = None
        self.fp8: FP8Decode | None = None
        self.xqa: XQADecode | None = None
        self.int8: Int8Decode | None = None
        heads = (num_q_heads, num_kv_heads, head_dim, pool.pages.dtype)
        if self._rotations is not None:
            self.int8 = Int8Decode(batch_size, num_q_heads, num_kv_heads, head_dim, scale, device)
            return
        if batch_size <= split_kv_decode.MAX_BATCH and split_kv_decode.applies(*heads):
            self.split_kv = SplitKVDecode(
                batch_size, num_q_heads, num_kv_heads, head_dim, scale, device
            )
            return
        if fp8_decode.used_at(batch_size) and fp8_decode.applies(*heads):
            gpu = torch.cuda.get_device_name(device)
            splits = xqa_decode.splits_for(
                batch_size, num_kv_heads, gpu, fp8_kernel, xqa is not None
            )
            if splits and xqa is not None:
                self.xqa = XQADecode(batch_size, num_q_heads, num_kv_heads, head_dim, scale,
                                     pool.page_size, pool.compute_dtype, xqa, splits)  # fmt: skip
            else:
                self.fp8 = FP8Decode(batch_size, num_q_heads, num_kv_heads, head_dim, scale,
                                     device)  # fmt: skip
            return
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
            paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )  # fmt: skip

    @property
    def accepts_token_rows(self) -> bool:
        """Whether rows may be tokens of one sequence (a prefill chunk, one row per token)."""
        return self.split_kv is None

    def plan(self, batch: AttentionBatch) -> None:
        if len(batch.q_lens) != self.batch_size or not batch.is_decode:
            raise ValueError(f"a graph for {self.batch_size} decode rows got {batch.q_lens}")
        self.slot_pages.copy_(batch.slot_pages, non_blocking=True)
        self.slot_offsets.copy_(batch.slot_offsets, non_blocking=True)
        if self.xqa is not None:
            kv_lens = host_array(np.asarray(batch.kv_lens, dtype=np.int32), self.slot_pages.device)
            self.xqa.plan(batch.page_table, kv_lens)
            return
        meta = paged_metadata(batch, self.pool.page_size)
        if self.split_kv is None and self.fp8 is None and self.int8 is None:
            assert self._wrapper is not None
            self._plan_decode(self._wrapper, meta)
            return
        self.kv_indptr.copy_(meta.kv_indptr, non_blocking=True)
        self.last_page_len.copy_(meta.last_page_len, non_blocking=True)
        self.kv_indices[: meta.kv_indices.numel()].copy_(meta.kv_indices, non_blocking=True)

    def forward_rotary(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The parent's, or at batch 1 the one-launch kernel (which also writes k and v, and
        applies `qk_norm`); over an int8 pool the write kernel also rotates q by H for the
        decode kernel (two launches a layer fewer than rotating it here)."""
        if self.int8 is not None and self._rope_kernel_takes(q, k):
            assert self._rotations is not None
            kv = self.pool.layer(layer_id)
            q_by_h = rotary_store_int8(
                q, k, v, cos, sin, kv, self._rotations.half, self.slot_pages, self.slot_offsets,
                rotate_q_by_h=True, qk_norm=qk_norm,
            )  # fmt: skip
            table = (self.kv_indptr, self.kv_indices, self.last_page_len)
            return self._rotations.decode_rotated(self.int8, kv, q_by_h, table, q.dtype)
        if self.split_kv is None:
            return super().forward_rotary(layer_id, q, k, v, cos, sin, qk_norm)
        if qk_norm is not None and not self._rope_kernel_takes(q, k):
            q, k = qk_norm.apply(q, k)  # the kernel's norms round to the pool's dtype
            qk_norm = None
        kv = self.pool.layer(layer_id)
        return self.split_kv.forward(
            q.to(kv.dtype), k.to(kv.dtype), v.to(kv.dtype), cos, sin, kv, self.kv_indptr,
            self.kv_indices, self.last_page_len, self.slot_pages, self.slot_offsets, qk_norm,
        )  # fmt: skip

    def rotary_store(
        self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> rope.RotaryStore | None:
        """The parent's, but not at batch 1, whose kernel rotates and writes in the attention."""
        return None if self.split_kv is not None else super().rotary_store(layer_id, cos, sin)

    def _run(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            assert self._rotations is not None
            table = (self.kv_indptr, self.kv_indices, self.last_page_len)
            return self._rotations.decode(self.int8, self.pool.layer(layer_id), q, *table)
        if self.xqa is None and self.fp8 is None:
            return super()._run(layer_id, q)
        kv, scales = self.pool.layer(layer_id), self.pool.scales
        k_scale, v_scale = scales.k[layer_id], scales.v[layer_id]
        if self.xqa is not None:
            return self.xqa.forward(q, kv, k_scale, v_scale)
        assert self.fp8 is not None
        return self.fp8.forward(
            q, kv, self.kv_indptr, self.kv_indices, self.last_page_len, k_scale, v_scale
        )
