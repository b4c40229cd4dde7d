"""Which pools have a live replica, from the stats board (`workers/serve/stats_board.py`).

Every replica posts there about once a second, from a heartbeat thread too, so a replica busy
in a long step stays live and only a dead (or never started) one goes stale within
`STALE_AFTER_S`; one whose engine died (`EngineStats.dead`) posts that at once. The router asks
it before it sends a request to a pool and while it waits for a replica to take one: a pool
without a live replica is skipped at once when another pool can serve (decode replicas prefill;
the prefill replica decodes), instead of a wait for a replica that Serve may start only after
the failover deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from workers.api import read_pool

logger = logging.getLogger(__name__)

FRESH_S = 0.5  # a pool's verdict is reused for this long: one board read serves many requests
READ_TIMEOUT_S = 2.0  # the longest a board read may take; past it the verdict is "unknown"


class PoolLiveness:
    """`down(pool)`: whether the board shows no live replica of `pool` in `app`. Unknown (no
    app, outside Ray, a failed read) counts as up: the caller then waits as it would anyway."""

    def __init__(
        self, app: str | None, clock: Callable[[], float] = time.monotonic,
        read: Callable[[str, str], list] = read_pool,  # type: ignore[type-arg]  # Posted
    ) -> None:  # fmt: skip
        self.app = app
        self.clock = clock
        self.read = read
        self._verdicts: dict[str, tuple[float, bool]] = {}  # pool -> (read at, down)
        self._lock = asyncio.Lock()

    async def down(self, pool: str) -> bool:
        if self.app is None:
            return False
        async with self._lock:  # concurrent requests share one read
            seen = self._verdicts.get(pool)
            if seen is not None and self.clock() - seen[0] < FRESH_S:
                return seen[1]
            try:
                posted = await asyncio.wait_for(
                    asyncio.to_thread(self.read, self.app, pool), READ_TIMEOUT_S
                )
            except Exception as e:  # noqa: BLE001 - unknown: assume up, as before the board
                logger.warning("reading the %s pool's liveness failed: %r", pool, e)
                return False
            down = not any(p.live and not p.stats.dead for p in posted)
            self._verdicts[pool] = (self.clock(), down)
            return down
