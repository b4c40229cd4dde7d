"""Errors of the KV transport. Each says what failed and why; none is retried silently."""

from __future__ import annotations


class TransportUnavailableError(RuntimeError):
    """NIXL cannot be imported, or its agent / UCX backend cannot be created. Raised at start."""


DTYPE_FIX = (
    ": the prefill and decode pools must store KV alike (engine.kv_cache_dtype and dtype the "
    "same on both)"
)


class KVLayoutMismatchError(ValueError):
    """KV pages that cannot be read into the local pool: a peer's layout is not the one expected,
    or differs in more than its KV heads (layers, page size, head size, dtype)."""


class TransferError(RuntimeError):
    """A READ or notification could not be posted (e.g. the peer's process is gone)."""


class PeerUnavailableError(TransferError):
    """A peer cannot be loaded: no metadata under its name, or its agent is unreachable."""
