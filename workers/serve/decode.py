"""The decode pool's Serve deployment: one replica = one `DecodeEngine`.

`generate(req, first)` (`EngineWorker.generate`) decodes a request prefilled elsewhere (its KV
is pulled over NIXL); `generate(req)` without `first` serves it entirely here (the colocated mode);
`generate(req, first)` with a `first` that has no KV handle resumes a stream whose decode
replica failed: `first` holds the tokens already streamed (`HandoffEngine.resume`).
"""

from __future__ import annotations

from typing import Any

from workers.disagg.decode import DecodeEngine
from workers.protocol import GenerateRequest, RequestOutput
from workers.serve.worker import EngineWorker


class DecodeWorker(EngineWorker):
    engine_class = DecodeEngine
    engine: DecodeEngine

    def _admit(self, req: GenerateRequest, first: RequestOutput | None) -> object:
        return self.engine.add_request(req) if first is None else self.engine.add_remote(req, first)

    def record_routing_stats(self) -> dict[str, Any]:
        s = self.loop.stats()
        return {
            "num_running": s.num_running + s.num_handoffs_pending,
            "kv_free_pages": s.kv_pages_total - s.kv_pages_held,
            "lora_ids": s.lora_resident_ids,  # the router prefers a replica holding the adapter
        }
