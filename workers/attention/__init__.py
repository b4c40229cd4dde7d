"""Attention backends behind one interface, chosen by name; GPU-only ones import lazily."""

from __future__ import annotations

from workers.attention.base import AttentionBackend, AttentionBatch
from workers.kvcache.pool import KVPool

BACKENDS = ("torch", "flashinfer")


def create_backend(
    name: str, pool: KVPool, num_q_heads: int, scale: float, tensor_cores: bool | None = None
) -> AttentionBackend:
    """`tensor_cores`: FlashInfer's decode (`KernelConfig.flashinfer_decode_tensor_cores`)."""
    if name == "torch":
        from workers.attention.torch_ref import TorchAttention

        return TorchAttention(pool, num_q_heads, scale)
    if name == "flashinfer":
        from workers.attention.flashinfer import FlashInferAttention  # CUDA only

        return FlashInferAttention(pool, num_q_heads, scale, tensor_cores=tensor_cores)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "BACKENDS"]
