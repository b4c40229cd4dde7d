"""The router replicas' request metrics, shared through the stats board so any one can render all.

Each router replica posts its `RequestStats` once a second from a background task under
`<app>/router/<replica>` (`workers/serve/stats_board.py`); /metrics adds the other replicas'
entries to this replica's live values: dead replicas' too, whose requests stay counted, so a
total never goes down when Serve replaces a router replica. A scrape posts this replica's live
values first: a later scrape, on whichever replica, renders at least as much. Best effort and
bounded: a failure or a wait past `BOARD_TIMEOUT_S` is logged, never raised, and /metrics then
shows what it has (the last peers it read, so a failed read never lowers a total).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.request_stats import RequestStats
from workers.api import POST_INTERVAL_S, StatsPoster, read_role

logger = logging.getLogger(__name__)

ROLE = "router"
BOARD_TIMEOUT_S = 2.0  # the most a scrape waits on the board, each way


class MetricsBoard:
    """This router replica's place on the board of `app`."""

    def __init__(self, app: str, replica: str) -> None:
        self.app = app
        self.replica = replica
        self.poster = StatsPoster(app, ROLE, replica)
        self.last_peers: list[RequestStats] = []

    async def post(self, stats: RequestStats, force: bool = False) -> None:
        """Post `stats` if one is due (at once with `force`)."""
        try:  # a blocking GCS call, in a thread
            await asyncio.wait_for(asyncio.to_thread(self.poster, stats, force), BOARD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort: the next post may work
            logger.exception("posting the router's request metrics failed")

    async def peers(self, mine: RequestStats | None = None) -> list[RequestStats]:
        """The other router replicas' request metrics as last posted, dead ones' included (this
        one's are live, not read); `mine`, this replica's live values, is posted first."""
        if mine is not None:
            await self.post(mine, force=True)
        try:
            read = asyncio.to_thread(read_role, self.app, ROLE, RequestStats)
            posted = await asyncio.wait_for(read, BOARD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - render the peers as last read
            logger.exception("reading the router replicas' request metrics failed")
            return self.last_peers
        self.last_peers = [e.stats for replica, e in posted.items() if replica != self.replica]
        return self.last_peers

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
