"""The decode pool's Serve deployment: one replica = one `DecodeEngine` on its own loop thread.

`generate(req, first)` decodes a request prefilled elsewhere (its KV is pulled over NIXL);
`generate(req)` without `first` serves it entirely here (the colocated path, also used when no
prefill pool is deployed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from workers.config import EngineConfig
from workers.decode_engine import DecodeEngine
from workers.engine_core import EngineStats
from workers.engine_loop import AsyncEngine
from workers.handoff import KVTransferConfig
from workers.prefill_worker import replica_tag
from workers.protocol import GenerateRequest, RequestOutput


class DecodeWorker:
    def __init__(self, engine: dict[str, Any], kv_transfer: dict[str, Any]) -> None:
        self.engine = DecodeEngine(
            EngineConfig.model_validate(engine),
            KVTransferConfig.model_validate(kv_transfer),
            replica_tag(),
        )
        self.loop = AsyncEngine(self.engine)

    async def generate(
        self, req: GenerateRequest, first: RequestOutput | None = None
    ) -> AsyncIterator[RequestOutput]:
        if first is None:
            stream = self.loop.generate(req)
        else:
            stream = self.loop.stream(req.request_id, lambda: self.engine.add_remote(req, first))
        async for chunk in stream:
            yield chunk

    async def stats(self) -> EngineStats:
        return self.loop.stats()

    def check_health(self) -> None:
        self.loop.check_alive()

    def record_routing_stats(self) -> dict[str, float]:
        s = self.loop.stats()
        return {
            "num_running": s.num_running + s.num_handoffs_pending,
            "kv_free_pages": s.kv_pages_total - s.kv_pages_used,
        }
