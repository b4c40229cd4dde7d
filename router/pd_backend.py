"""The disaggregated backend: prefill on one pool, then decode on another, streamed as one.

1. `prefill.prefill(req)` computes the prompt on a prefill replica and returns the first chunk
   (the first token, which is streamed at once: that is TTFT) with a `KVHandle`.
2. `decode.generate(req, first)` pulls the prompt's pages over NIXL on a decode replica and
   streams the remaining tokens.
If the client goes away between the two, the prefill replica is told to unpin the prompt's pages
at once instead of waiting for the lease to expire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from router.backend import RoleStats
from workers.protocol import GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)


class DisaggregatedBackend:
    def __init__(self, prefill: Any | None, decode: Any) -> None:
        """`prefill` / `decode`: Serve DeploymentHandles of the two pools; without a prefill
        pool (colocated mode) decode replicas serve whole requests."""
        self.prefill = prefill
        self.decode = decode.options(stream=True)
        self.decode_stats = decode

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.prefill is None:
            async for chunk in self.decode.generate.remote(req):
                yield chunk
            return
        first: RequestOutput = await self.prefill.prefill.remote(req)
        kv = first.kv
        yield first.model_copy(update={"kv": None})
        if first.finished or kv is None:
            return
        decoding = False
        try:
            async for chunk in self.decode.generate.remote(req, first):
                decoding = True
                yield chunk
        finally:
            if not decoding:  # the decode side never took the pages: unpin them now
                release = self.prefill.release.remote(kv.agent_names[0], kv.lease_id)
                await asyncio.shield(asyncio.ensure_future(_quietly(release)))

    async def stats(self) -> list[RoleStats]:
        d = await self.decode_stats.stats.remote()
        if self.prefill is None:
            return [RoleStats("colocated", d)]
        p = await self.prefill.stats.remote()
        return [RoleStats("prefill", p), RoleStats("decode", d)]


async def _quietly(response: Any) -> None:
    try:
        await response
    except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
        logger.warning("releasing a prefill lease failed: %r", e)
