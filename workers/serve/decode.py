"""The decode pool's Serve deployment: one replica = one `DecodeEngine`.

`generate(req, first)` decodes a request prefilled elsewhere (its KV is pulled over NIXL);
`generate(req)` without `first` serves it entirely here (the colocated mode).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from workers.disagg.decode import DecodeEngine
from workers.protocol import GenerateRequest, RequestOutput
from workers.serve.worker import EngineWorker


class DecodeWorker(EngineWorker):
    engine_class = DecodeEngine
    engine: DecodeEngine

    async def generate(
        self, req: GenerateRequest, first: RequestOutput | None = None
    ) -> AsyncIterator[RequestOutput]:
        if first is None:
            stream = self.loop.generate(req)
        else:
            stream = self.loop.stream(req.request_id, lambda: self.engine.add_remote(req, first))
        async for chunk in stream:
            yield chunk

    def record_routing_stats(self) -> dict[str, float]:
        s = self.loop.stats()
        return {
            "num_running": s.num_running + s.num_handoffs_pending,
            "kv_free_pages": s.kv_pages_total - s.kv_pages_used,
        }
