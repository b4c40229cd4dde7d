"""FlashInfer paged attention (CUDA, bf16/fp16): prefill with cached prefixes, and decode.

An FP8 pool (`kvcache/kv_dtype.py`) is read by the same wrappers planned with an FP8 KV dtype
and the pool's compute dtype for queries (FlashInfer's mixed-precision kernels), each layer's
K and V scales passed to `run`; CUDA-graph decode steps read it with a Triton kernel instead
(`kernels/fp8_decode.py`), or on Hopper with FlashInfer's XQA (`xqa_decode.py`), whichever the
GPU's table has the faster at the batch size.

An int8 pool (rows with their own scales) has no FlashInfer kernel: `int8_steps.py` says
what reads it; its rows are written by `rope_int8.rotary_store_int8`, not in a GEMM's epilogue.

FlashInfer reads a page table in CSR form (`paged_metadata.py`).

Two backends share the per-layer work (write the new K/V into the pool, then attend; the model
calls `forward_rotary`, which also applies the rotary embedding to q and k, and Qwen3's q/k
norms before it, in the kernel that writes K/V, `rope.rotary_store`):
- `FlashInferAttention` plans whatever step comes: a decode wrapper when every sequence adds one
  token, else a causal prefill wrapper whose queries are the last `q_len` of `kv_len` positions.
- `GraphDecodeAttention` (`graph_decode.py`) serves decode steps of exactly one batch size from
  fixed buffers, so a CUDA graph captured over the model can be replayed after each re-plan
  (`engine/cuda_graph.py`).
"""

from __future__ import annotations

from typing import TypeAlias

import flashinfer
import torch

from workers.attention.base import AttentionBackend, AttentionBatch, store_kv
from workers.attention.int8_steps import Int8Rotations, Int8Steps
from workers.attention.paged_metadata import PagedMetadata, paged_metadata
from workers.attention.replan_gate import ReplanGate
from workers.attention.rotary import apply_rotary
from workers.config import FLASHINFER_HEAD_DIMS
from workers.kernels import rope
from workers.kernels.norms import QKNorm
from workers.kernels.rope_int8 import rotary_store_int8
from workers.kvcache.pool import KVPool

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's split-KV scratch; 128 MiB is its recommended floor
# Decode on tensor cores (FlashInfer's fa2 prefill kernels, each GQA group packed as query rows)
# or on its CUDA-core decode kernel. `auto` takes tensor cores for groups of 4 or more query heads
# per KV head: on an H200 with Llama-3-8B shapes (group 4) they cut a CUDA-graph decode step by
# 4% at batch 1 and by 24% at 64 x 2048 (bench/bench_decode.py). Smaller groups keep the
# CUDA-core kernel (not measured against the other). True / False force either
# (`KernelConfig.flashinfer_decode_tensor_cores`).
MIN_TENSOR_CORE_GROUP = 4


def decode_on_tensor_cores(choice: bool | None, num_q_heads: int, num_kv_heads: int) -> bool:
    if choice is not None:
        return choice
    return num_q_heads // num_kv_heads >= MIN_TENSOR_CORE_GROUP


_FLOAT16 = (torch.bfloat16, torch.float16)
_Wrapper: TypeAlias = (
    flashinfer.BatchDecodeWithPagedKVCacheWrapper | flashinfer.BatchPrefillWithPagedKVCacheWrapper
)


def new_workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class PagedFlashInfer(AttentionBackend):
    """Shared per-layer work. Invariant: `plan` sets `_wrapper`, `_slot_pages` and
    `_slot_offsets` before any `forward` of the step."""

    def __init__(
        self, pool: KVPool, num_q_heads: int, scale: float, tensor_cores: bool | None = None
    ) -> None:
        super().__init__(pool, num_q_heads, scale)
        if pool.pages.device.type != "cuda" or pool.compute_dtype not in _FLOAT16:
            raise ValueError(
                "the flashinfer backend needs a CUDA KV pool for bfloat16 or float16, got "
                f"{pool.compute_dtype} on {pool.pages.device}; use attention_backend='torch'"
            )
        layout = pool.layout
        if layout.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"the flashinfer backend has kernels for head_dim {FLASHINFER_HEAD_DIMS}, this "
                f"model's is {layout.head_dim}; use attention_backend='torch' (or 'auto')"
            )
        self._heads = (num_q_heads, layout.num_kv_heads, layout.head_dim, layout.page_size)
        self._tensor_cores = decode_on_tensor_cores(tensor_cores, num_q_heads, layout.num_kv_heads)
        int8 = pool.pages.dtype == torch.int8
        # An int8 pool's pages reach FlashInfer dequantized (prefill): in the compute dtype.
        kv_dtype = pool.compute_dtype if int8 else pool.pages.dtype
        self._plan_dtypes = dict(q_data_type=pool.compute_dtype, kv_data_type=kv_dtype)
        # An int8 pool's Hadamard matrices (q, the output, the writes); None for other pools.
        self._rotations = Int8Rotations(pool, num_q_heads) if int8 else None
        self._wrapper: _Wrapper | None = None
        self._slot_pages = self._slot_offsets = torch.empty(0)
        self._plans = ReplanGate()  # a plan's pinned source outlives its queued copy

    def _plan_decode(
        self, wrapper: flashinfer.BatchDecodeWithPagedKVCacheWrapper, meta: PagedMetadata
    ) -> None:
        self._plans.plan(
            wrapper, meta.kv_indptr, meta.kv_indices, meta.last_page_len, *self._heads,
            sm_scale=self.scale, **self._plan_dtypes,
        )  # fmt: skip

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        store_kv(self.pool, layer_id, k, v, self._slot_pages, self._slot_offsets)
        return self._run(layer_id, q.to(self.pool.compute_dtype))

    def _run(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Attend with the planned wrapper; an FP8 pool's scales go in as FlashInfer's
        `k_scale` (folded into the softmax scale) and `v_scale` (applied to the output)."""
        assert self._wrapper is not None, "plan() first"
        kv, scales = self.pool.layer(layer_id), self.pool.scales
        k_scale, v_scale = scales.k[layer_id], scales.v[layer_id]
        if k_scale == v_scale == 1.0:
            return self._wrapper.run(q, kv)
        return self._wrapper.run(q, kv, k_scale=k_scale, v_scale=v_scale)

    def forward_rotary(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`forward` of q and k before their rotary embedding and `qk_norm` (Qwen3's per-head
        RMSNorms): one Triton kernel norms and rotates q and k and writes k and v into the pool
        (1 launch a layer instead of 2 rotary kernels and 2 index writes, and 2 norms and 2
        copies). Same values as `qk_norm.apply`, `rope.rotary`, then `forward` (the fallback)."""
        if not self._rope_kernel_takes(q, k):
            if qk_norm is not None:
                q, k = qk_norm.apply(q, k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            return self.forward(layer_id, q, k, v)
        kv, scales = self.pool.layer(layer_id), self.pool.scales
        if self._rotations is not None:
            q = rotary_store_int8(q, k, v, cos, sin, kv, self._rotations.half, self._slot_pages,
                                  self._slot_offsets, qk_norm=qk_norm)  # fmt: skip
            return self._run(layer_id, q)
        q = rope.rotary_store(q, k, v, cos, sin, kv, self._slot_pages, self._slot_offsets,
                              scales.k[layer_id], scales.v[layer_id], qk_norm)  # fmt: skip
        return self._run(layer_id, q)

    def _rope_kernel_takes(self, *tensors: torch.Tensor) -> bool:
        """Whether `rope`'s kernels take these q/k/cos tensors: in the pool's compute dtype,
        heads of a power-of-2 half."""
        half = tensors[0].shape[-1] // 2
        dtype = self.pool.compute_dtype
        return all(t.dtype == dtype for t in tensors) and not half & (half - 1)

    def rotary_store(
        self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> rope.RotaryStore | None:
        """What `forward_rotary`'s kernel does, for the q/k/v GEMM's epilogue; None where that
        kernel would not run, or writes int8 rows (whose rotation and scale need whole rows
        of a head, which the epilogue's tiles do not hold)."""
        if self._rotations is not None or not self._rope_kernel_takes(cos):
            return None
        kv, scales = self.pool.layer(layer_id), self.pool.scales
        return rope.RotaryStore(cos, sin, kv, self._slot_pages, self._slot_offsets,
                                scales.k[layer_id], scales.v[layer_id], self._heads[0])  # fmt: skip

    def attend_rotated(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        return self._run(layer_id, q)


class FlashInferAttention(PagedFlashInfer):
    """Any step: decode kernels for all-decode steps, causal prefill kernels otherwise."""

    def __init__(
        self, pool: KVPool, num_q_heads: int, scale: float,
        workspace: torch.Tensor | None = None, tensor_cores: bool | None = None,
    ) -> None:  # fmt: skip
        super().__init__(pool, num_q_heads, scale, tensor_cores)
        self.workspace = new_workspace(pool.pages.device) if workspace is None else workspace
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores)  # fmt: skip
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._int8_steps: Int8Steps | None = None
        if self._rotations is not None:
            self._int8_steps = Int8Steps(pool, self._rotations, self._heads, scale,
                                         self._prefill, self._plans, self._plan_dtypes)  # fmt: skip

    def plan(self, batch: AttentionBatch) -> None:
        meta = paged_metadata(batch, self.pool.page_size)
        self._slot_pages, self._slot_offsets = batch.slot_pages, batch.slot_offsets
        if self._int8_steps is not None:
            self._int8_steps.plan(batch, meta)
            return
        if batch.is_decode:
            self._plan_decode(self._decode, meta)
            self._wrapper = self._decode
            return
        # causal: bottom-right aligned, query i of q_len sits at kv_len - q_len + i
        self._plans.plan(
            self._prefill, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len,
            *self._heads, causal=True, sm_scale=self.scale, **self._plan_dtypes,
        )  # fmt: skip
        self._wrapper = self._prefill

    def _run(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        if self._int8_steps is not None:
            return self._int8_steps.run(layer_id, q)
        return super()._run(layer_id, q)
