"""Which replicas of a pool have a dead engine, so the request routers skip them at once, before
Serve's health check replaces them. Two sources, one view per (app, pool) in a process:
- a call's `EngineDeadError` names its replica (`DisaggregatedBackend` marks it here as soon as
  the failure comes back, before its re-send is routed);
- the stats board, where a replica whose step failed posts it at once (`EngineStats.
  engine_deaths`): what other router processes, or requests that have not failed, learn from.
  Read off the event loop (a blocking GCS call, in a thread), at most once per `REFRESH_S` and
  only while requests are routed; a routing decision never waits for a read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from workers.api import EngineDeadError, EngineStats, read_role

logger = logging.getLogger(__name__)

REFRESH_S = 0.25
_views: dict[tuple[str, str], DeadReplicas] = {}


def dead_replica(exc: BaseException | None) -> str | None:
    """The replica an `EngineDeadError` in `exc`'s cause chain names (Ray wraps it)."""
    for _ in range(8):
        cause = getattr(exc, "cause", None)  # Ray's wrapper (an instance of its cause's class)
        if cause is None and isinstance(exc, EngineDeadError):
            return exc.replica
        exc = cause or getattr(exc, "__cause__", None)
    return None


class DeadReplicas:
    def __init__(self, app: str, pool: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.pool, self._clock = app, pool, clock
        self._posted: frozenset[str] = frozenset()  # as last read from the board
        self._marked: set[str] = set()
        self._next_read = 0.0
        self._reading: asyncio.Future[frozenset[str]] | None = None

    @classmethod
    def of(cls, app: str, pool: str) -> DeadReplicas:
        """This process's view of `pool` in `app`."""
        return _views.setdefault((app, pool), cls(app, pool))

    def mark(self, exc: BaseException) -> None:
        """Count the replica named by the `EngineDeadError` in `exc`, if any, as dead."""
        replica = dead_replica(exc)
        if replica is not None and replica not in self._marked:
            logger.warning("%s replica %s: its engine died; skipped", self.pool, replica)
            self._marked.add(replica)

    def dead(self) -> frozenset[str]:
        """The replicas (`ReplicaID.unique_id`) known dead; starts the next read of the board
        when one is due (call on the router's loop)."""
        now = self._clock()
        if self._reading is None and now >= self._next_read:
            self._next_read = now + REFRESH_S
            self._reading = asyncio.get_running_loop().run_in_executor(None, self._read)
            self._reading.add_done_callback(self._done)
        return self._posted | self._marked

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
        self._posted = reading.result()
