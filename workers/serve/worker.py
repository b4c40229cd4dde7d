"""What both pools' Serve deployments share: an engine of one role on its own loop thread.

Plain classes; `cluster/app.py` wraps them with `serve.deployment` and each pool's resources.
"""

from __future__ import annotations

from typing import Any, ClassVar

from workers.config import EngineConfig, KVTransferConfig
from workers.disagg.handoff import HandoffEngine
from workers.engine.async_engine import AsyncEngine
from workers.protocol import EngineStats
from workers.serve.kv_publisher import KVEventPublisher
from workers.serve.load_meter import LoadMeter
from workers.serve.stats_board import StatsPoster


def replica_context() -> Any:
    """This Serve replica's context (app name, replica id), or None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


class EngineWorker:
    engine_class: ClassVar[type[HandoffEngine]]

    def __init__(
        self, engine: dict[str, Any], kv_transfer: dict[str, Any], kv_events_period_s: float = 0
    ) -> None:
        """`kv_events_period_s`: publish the prefix cache's changes that often (0: never)."""
        ctx = replica_context()
        tag = None if ctx is None else str(ctx.replica_id.unique_id)
        self.engine = self.engine_class(
            EngineConfig.model_validate(engine), KVTransferConfig.model_validate(kv_transfer), tag
        )
        self.poster: StatsPoster | None = None
        self._posted_dead = False
        self.kv_events: KVEventPublisher | None = None
        if ctx is not None and tag is not None:
            self.poster = StatsPoster(ctx.app_name, self.engine.role, tag)
            radix = self.engine.kv.radix
            if kv_events_period_s > 0 and radix is not None:
                self.kv_events = KVEventPublisher(
                    ctx.app_name, ctx.deployment, tag, radix, kv_events_period_s
                )
        self.loop = AsyncEngine(self.engine, self._on_stats, tag)
        self.meter = LoadMeter()  # its signals for SLA autoscaling

    def _on_stats(self, stats: EngineStats) -> None:
        """On the engine loop thread after each step: KV events out, stats to the board."""
        if self.kv_events is not None:
            self.kv_events.collect()
            stats.kv_events_published = self.kv_events.num_published
        if self.poster is not None:
            # the engine's death at once: the routers stop sending here on reading it
            force = stats.dead and not self._posted_dead
            self._posted_dead |= self.poster(stats, force=force) and force

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
        return self.meter.snapshot(kv_usage=s.kv_pages_used / max(1, s.kv_pages_total),
                                   seat_usage=seats / self.engine.cfg.max_num_seqs)
