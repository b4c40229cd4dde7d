"""The decode pool's Serve deployment: one replica = one `DecodeEngine`.

`generate(req, first)` decodes a request prefilled elsewhere (its KV is pulled over NIXL);
`generate(req)` without `first` serves it entirely here (the colocated mode);
`generate(req, first)` with a `first` that has no KV handle resumes a stream whose decode
replica failed: `first` holds the tokens already streamed (`DecodeEngine.add_remote`).
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
        faults = self.engine.faults
        num_tokens = 0 if first is None else len(first.token_ids)
        timer = self.meter.stream(len(req.prompt_token_ids) if first is None else 0)
        try:
            async for chunk in stream:
                timer.chunk(len(chunk.token_ids))
                if faults is not None:
                    num_tokens += len(chunk.token_ids)
                    faults.strike("decode_token", req.prompt_token_ids, num_tokens)
                yield chunk
        finally:
            timer.close()

    def record_routing_stats(self) -> dict[str, float]:
        s = self.loop.stats()
        return {
            "num_running": s.num_running + s.num_handoffs_pending,
            "kv_free_pages": s.kv_pages_total - s.kv_pages_used,
        }
