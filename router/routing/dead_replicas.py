"""Which replicas of a pool have a dead engine, from the stats board: a replica whose step failed
posts it at once (`EngineStats.engine_deaths`), and the request routers skip it from then on,
without waiting for Serve's health check to replace it.

Read off the event loop (a blocking GCS call, in a thread), at most once per `REFRESH_S` and only
while requests are routed; a routing decision uses the last answer and never waits for a read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from workers.api import EngineStats, read_role

logger = logging.getLogger(__name__)

REFRESH_S = 0.25


class DeadReplicas:
    def __init__(self, app: str, pool: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.pool, self._clock = app, pool, clock
        self._dead: frozenset[str] = frozenset()
        self._next_read = 0.0
        self._reading: asyncio.Future[frozenset[str]] | None = None

    def dead(self) -> frozenset[str]:
        """The replicas (`ReplicaID.unique_id`) whose engine posted its death, as last read;
        starts the next read when one is due (call on the router's loop)."""
        now = self._clock()
        if self._reading is None and now >= self._next_read:
            self._next_read = now + REFRESH_S
            self._reading = asyncio.get_running_loop().run_in_executor(None, self._read)
            self._reading.add_done_callback(self._done)
        return self._dead

    def _read(self) -> frozenset[str]:
        posted = read_role(self.app, self.pool, EngineStats)
        return frozenset(replica for replica, p in posted.items() if p.stats.dead)

    def _done(self, reading: asyncio.Future[frozenset[str]]) -> None:
        self._reading = None
        if reading.cancelled():
            return
        if (e := reading.exception()) is not None:
            logger.warning("reading the %s pool's engine deaths failed: %s", self.pool, e)
            return
        dead = reading.result()
        if dead - self._dead:
            logger.warning("%s replicas with a dead engine, skipped: %s", self.pool,
                           sorted(dead - self._dead))  # fmt: skip
        self._dead = dead
