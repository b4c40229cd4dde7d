"""What both pools' Serve deployments share: an engine of one role on its own loop thread.

Plain classes; `cluster/app.py` wraps them with `serve.deployment` and each pool's resources.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from workers.config import EngineConfig, KVTransferConfig
from workers.disagg.handoff import HandoffEngine
from workers.engine.async_engine import AsyncEngine
from workers.engine_stats import EngineStats
from workers.protocol import GenerateRequest, RequestOutput
from workers.serve.kv_publisher import KVEventPublisher
from workers.serve.load_meter import LoadMeter
from workers.serve.lora_sync import LoRASync
from workers.serve.stats_board import StatsPoster


def replica_context() -> Any:
    """This Serve replica's context (app name, replica id), or None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


KEEPALIVE_S = 1.0  # a stream with nothing to send says its engine runs this often, at most


class EngineWorker:
    engine_class: ClassVar[type[HandoffEngine]]

    def __init__(
        self, engine: dict[str, Any], kv_transfer: dict[str, Any], kv_events_period_s: float = 0,
        stall_s: float = math.inf, lora_sync_period_s: float = 0,
    ) -> None:  # fmt: skip
        """`kv_events_period_s`: publish the prefix cache's changes that often (0: never).
        `stall_s`: a step running this long is stalled; streams stop sending keepalives then
        (the router's `replica_timeout_s`, which they are sent to beat).
        `lora_sync_period_s`: free adapters unloaded from the app's registry, read that often
        (0: never; `LoRASync`)."""
        ctx = replica_context()
        tag = None if ctx is None else str(ctx.replica_id.unique_id)
        self.engine = self.engine_class(
            EngineConfig.model_validate(engine), KVTransferConfig.model_validate(kv_transfer), tag
        )
        self.poster: StatsPoster | None = None
        self._posted_dead = False
        self.kv_events: KVEventPublisher | None = None
        self.lora_sync: LoRASync | None = None
        if ctx is not None and tag is not None:
            if lora_sync_period_s > 0:
                self.lora_sync = LoRASync(ctx.app_name, lora_sync_period_s)
            self.poster = StatsPoster(ctx.app_name, self.engine.role, tag)
            radix = self.engine.kv.radix
            if kv_events_period_s > 0 and radix is not None:
                self.kv_events = KVEventPublisher(
                    ctx.app_name, ctx.deployment, tag, radix, kv_events_period_s
                )
        self.loop = AsyncEngine(self.engine, self._on_stats, tag)
        self.meter = LoadMeter()  # its signals for SLA autoscaling
        self.stall_s = stall_s
        self.keepalive_s = min(KEEPALIVE_S, stall_s / 4)

    def _admit(self, req: GenerateRequest, first: RequestOutput | None) -> object:
        """Add a streamed request to the engine (each role its own way)."""
        raise NotImplementedError

    async def generate(
        self, req: GenerateRequest, first: RequestOutput | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream `req` from `first` on (`_admit`), with keepalives while the engine is busy."""
        stream = self.loop.stream(req.request_id, lambda: self._admit(req, first),
                                  self.keepalive_s, self.stall_s)  # fmt: skip
        faults = self.engine.faults
        num_tokens = 0 if first is None else len(first.token_ids)
        timer = self.meter.stream(len(req.prompt_token_ids) if first is None else 0)
        try:
            async for chunk in stream:
                if chunk.is_keepalive:
                    yield chunk
                    continue
                timer.chunk(len(chunk.token_ids))
                if faults is not None:
                    num_tokens += len(chunk.token_ids)
                    faults.strike("decode_token", req.prompt_token_ids, num_tokens)
                yield chunk
        finally:
            timer.close()

    def _on_stats(self, stats: EngineStats) -> None:
        """On the engine loop thread after each step: KV events out, stats to the board."""
        if self.kv_events is not None:
            self.kv_events.collect()
            stats.kv_events_published = self.kv_events.num_published
        if self.poster is not None:
            # the engine's death at once: the routers stop sending here on reading it
            force = stats.dead and not self._posted_dead
            self._posted_dead |= self.poster(stats, force=force) and force
        if self.lora_sync is not None:  # last: its registry read may fail, the stats are out
            self.lora_sync(self.engine)

    async def stats(self) -> EngineStats:
        return self.loop.stats()

    def check_health(self) -> None:
        """Polled by Serve: a dead engine, loop thread or TP rank marks the replica unhealthy
        (Serve then replaces it)."""
        self.loop.check_alive()
        check_ranks = getattr(self.engine.runner, "check_alive", None)
        if check_ranks is not None:
            check_ranks()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Serve for the pool's autoscaling policy (cluster/autoscaling_policy.py)."""
        s = self.loop.stats()
        seats = s.num_running + s.num_handoffs_pending  # decode: reads in flight take seats next
        return self.meter.snapshot(
            kv_usage=s.kv_pages_held / max(1, s.kv_pages_total),
            seat_usage=seats / self.engine.cfg.max_num_seqs,
        )
