"""The router replicas' request metrics, shared through the stats board so any one can render all.

Each router replica posts its `RequestStats` once a second from a background task under
`<app>/router/<replica>` (`workers/serve/stats_board.py`); /metrics adds the other replicas' fresh
entries to this replica's live values. Best effort: a failure is logged, never raised, and
/metrics then shows what it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.metrics import RequestStats
from workers.api import POST_INTERVAL_S, StatsPoster, read_role

logger = logging.getLogger(__name__)

ROLE = "router"


class MetricsBoard:
    """This router replica's place on the board of `app`."""

    def __init__(self, app: str, replica: str) -> None:
        self.app = app
        self.replica = replica
        self.poster = StatsPoster(app, ROLE, replica)

    async def post(self, stats: RequestStats) -> None:
        try:
            await asyncio.to_thread(self.poster, stats)  # a blocking GCS call
        except Exception:  # noqa: BLE001 - best effort: the next post may work
            logger.exception("posting the router's request metrics failed")

    async def peers(self) -> list[RequestStats]:
        """The other router replicas' fresh request metrics (this one's are live, not read)."""
        try:
            posted = await asyncio.to_thread(read_role, self.app, ROLE, RequestStats)
        except Exception:  # noqa: BLE001 - render this replica's own metrics alone
            logger.exception("reading the router replicas' request metrics failed")
            return []
        return [stats for replica, stats in posted.items() if replica != self.replica]

    async def run(self, snapshot: Callable[[], RequestStats]) -> None:
        """Post `snapshot()` every interval until cancelled, so an unscraped replica stays in."""
        while True:
            try:
                stats = snapshot()
            except Exception:  # noqa: BLE001 - keep the task alive for the next round
                logger.exception("snapshotting the router's request metrics failed")
            else:
                await self.post(stats)
            await asyncio.sleep(POST_INTERVAL_S)
