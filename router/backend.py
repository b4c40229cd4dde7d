"""What the HTTP layer needs from whoever generates: a token stream per request, and stats.

The OpenAI app (`router.openai_api`) only talks to a `GenerationBackend`. `LocalBackend` wraps one
colocated `AsyncEngine`; a disaggregated prefill -> decode backend implements the same two methods.

Contract of `generate`:
- it is an async generator of `RequestOutput` chunks; the last one has `finish_reason` set;
- a request that can never be served (prompt too long for the KV pool, token ids outside the
  vocabulary) raises `ValueError` (e.g. `RequestRejectedError`) from the first `__anext__`, and the
  router answers 400 with its message;
- closing the generator early (`aclose()`, or cancelling the task that iterates it) aborts the
  request and frees its KV pages on every worker that holds them. The router always closes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

from workers.api import EngineStats, GenerateRequest, RequestOutput


class RoleStats(NamedTuple):
    """One engine's counters, named by its role: "prefill", "decode" or "colocated". A dead
    replica's last snapshot is not `live`: its counters still count, its gauges no more."""

    role: str
    stats: EngineStats
    live: bool = True


class GenerationBackend(Protocol):
    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream `req`'s output chunks (an async generator; see the module's contract)."""
        ...

    async def stats(self) -> list[RoleStats]:
        """A snapshot per engine (several per role when a pool has replicas), for /metrics."""
        ...


class StreamingEngine(Protocol):
    """What `LocalBackend` needs of an engine (`workers.api.AsyncEngine` has it)."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> EngineStats: ...


class LocalBackend:
    """The colocated engine in this process: prefill and decode in one `AsyncEngine`."""

    def __init__(self, engine: StreamingEngine, role: str = "colocated") -> None:
        self.engine = engine
        self.role = role

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(req)

    async def stats(self) -> list[RoleStats]:
        return [RoleStats(self.role, self.engine.stats())]
