"""The attention backend interface: plan once per forward step, then run once per layer.

A step's tokens are packed: sequence i owns query rows `[cu_q_lens[i], cu_q_lens[i+1])`. After the
step its KV spans `kv_lens[i]` tokens held in pages `page_table[i, :ceil(kv_lens[i] / page_size)]`;
the last `q_lens[i]` of those tokens are the new ones, whose K/V the backend writes into the pool
at (`slot_pages`, `slot_offsets`) before attending. Rows of `page_table` past a sequence's pages are
padded with page 0, the scratch page, which no sequence owns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.kvcache.kv_dtype import as_bytes, quantize
from workers.kvcache.pool import KVPool

if TYPE_CHECKING:
    from workers.kernels.rope import RotaryStore


@dataclass
class AttentionBatch:
    q_lens: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor  # [batch, max_pages] int32, on the pool's device
    slot_pages: torch.Tensor  # [num_tokens] int64: page of each new token's KV
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot inside that page

    def __post_init__(self) -> None:
        assert len(self.q_lens) == len(self.kv_lens) == self.page_table.shape[0]
        assert self.slot_pages.device == self.page_table.device == self.slot_offsets.device
        assert all(0 < q <= kv for q, kv in zip(self.q_lens, self.kv_lens))

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the decode kernels apply."""
        return all(q == 1 for q in self.q_lens)


class AttentionBackend(ABC):
    """Paged attention over one rank's KV pool, for `num_q_heads` query heads of that rank."""

    def __init__(self, pool: KVPool, num_q_heads: int, scale: float) -> None:
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.scale = scale

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None:
        """Prepare per-step metadata; called once before the layers run."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` for the new tokens: store k/v, return `[T, Hq, D]`."""

    def store_kv(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> None:
        store_kv(self.pool, layer_id, k, v, batch.slot_pages, batch.slot_offsets)

    def rotary_store(
        self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> RotaryStore | None:
        """Where the q/k/v GEMM may write this step's K/V itself, rotating q and k in its
        epilogue (CUDA backends); then `attend_rotated` attends. None: the model calls
        `forward` (or `forward_rotary`) with q, k and v."""
        return None

    def attend_rotated(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rotated q `[T, Hq, D]` whose K/V are already written."""
        raise NotImplementedError(f"{type(self).__name__} has no rotary_store")


def store_kv(
    pool: KVPool, layer_id: int, k: torch.Tensor, v: torch.Tensor,
    slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
) -> None:  # fmt: skip
    """Write the new tokens' k/v `[T, Hkv, D]` into their slots, quantized as the pool stores."""
    kv, scales = pool.layer(layer_id), pool.scales
    raw = as_bytes(kv)
    raw[slot_pages, 0, slot_offsets] = as_bytes(quantize(k, kv.dtype, scales.k[layer_id]))
    raw[slot_pages, 1, slot_offsets] = as_bytes(quantize(v, kv.dtype, scales.v[layer_id]))
