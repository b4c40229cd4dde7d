"""The prefill pool's Serve deployment: one replica = one `PrefillEngine`.

`prefill(req)` computes a prompt for a decode replica to read; `generate(req, first)`
(`EngineWorker.generate`) runs a request here to its end, for the router while no decode replica
lives: from the start, or from a failed decode replica's stream (`first`, no KV handle).
"""

from __future__ import annotations

from typing import Any

from workers.disagg.prefill import PrefillEngine
from workers.protocol import GenerateRequest, RequestOutput
from workers.serve.worker import EngineWorker


class PrefillWorker(EngineWorker):
    engine_class = PrefillEngine
    engine: PrefillEngine

    async def prefill(self, req: GenerateRequest) -> RequestOutput:
        """Compute the prompt and the first token; the chunk's `kv` names the pinned pages."""
        stream = self.loop.generate(req)
        try:
            with self.meter.prefill(len(req.prompt_token_ids)):
                first = await anext(stream)
        finally:
            await stream.aclose()  # after a hand-off this aborts nothing (see AsyncEngine)
        if self.engine.faults is not None:
            self.engine.faults.strike("prefill", req.prompt_token_ids)
        return first

    def _admit(self, req: GenerateRequest, first: RequestOutput | None) -> object:
        return self.engine.run_whole(req, first)

    async def release(self, agent_name: str, lease_id: str) -> None:
        """Unpin a prompt whose decode side will never read it (the client went away); the
        lease may be held by another replica of the pool (`agent_name` says which)."""
        await self.loop.run(lambda: self.engine.release_lease_of(agent_name, lease_id))

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for request routers: this replica's load."""
        s = self.loop.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_usage": s.kv_pages_held / max(1, s.kv_pages_total),
            "lora_ids": s.lora_resident_ids,  # the router prefers a replica holding the adapter
        }
