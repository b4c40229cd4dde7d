"""The prefill pool's Serve deployment: one replica = one `PrefillEngine` on its own loop thread.

Plain class; `cluster/app.py` wraps it with `serve.deployment` and the pool's resources.
"""

from __future__ import annotations

import logging
from typing import Any

from workers.config import EngineConfig
from workers.engine_core import EngineStats
from workers.engine_loop import AsyncEngine
from workers.handoff import KVTransferConfig
from workers.prefill_engine import PrefillEngine
from workers.protocol import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)


def replica_tag() -> str | None:
    """This Serve replica's id, to name NIXL agents after (None outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


class PrefillWorker:
    def __init__(self, engine: dict[str, Any], kv_transfer: dict[str, Any]) -> None:
        self.engine = PrefillEngine(
            EngineConfig.model_validate(engine),
            KVTransferConfig.model_validate(kv_transfer),
            replica_tag(),
        )
        self.loop = AsyncEngine(self.engine)

    async def prefill(self, req: GenerateRequest) -> RequestOutput:
        """Compute the prompt and the first token; the chunk's `kv` names the pinned pages."""
        stream = self.loop.generate(req)
        try:
            return await anext(stream)
        finally:
            await stream.aclose()  # after a hand-off this aborts nothing (see AsyncEngine)

    async def release(self, lease_id: str) -> None:
        """Unpin a prompt whose decode side will never read it (the client went away)."""
        await self.loop.run(lambda: self.engine.release_lease(lease_id))

    async def stats(self) -> EngineStats:
        return self.loop.stats()

    def check_health(self) -> None:
        self.loop.check_alive()

    def record_routing_stats(self) -> dict[str, float]:
        """Polled by Serve for request routers: this replica's load."""
        s = self.loop.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_usage": s.kv_pages_used / max(1, s.kv_pages_total),
        }
