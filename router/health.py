"""/health from memory: a background task asks Serve's controller which pools have a live replica.

/health must answer in milliseconds under any load and say 503 while a pool cannot serve; asking
the pools themselves (a handle call) queues behind their requests, and waits for ever when a
pool has no replica. So `PoolWatch.run()` reads `serve.status()` every `period_s` off the event
loop and /health answers with what it last saw. A replica that dies is RUNNING until the
controller notices (at its next health check, `health_check_period_s`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RUNNING = "RUNNING"


def serve_status() -> Any:
    from ray import serve

    return serve.status()


class PoolWatch:
    """Whether each of `pools` (deployment names of application `app`) has a RUNNING replica."""

    def __init__(
        self,
        app: str,
        pools: Sequence[str],
        period_s: float = 1.0,
        status: Callable[[], Any] = serve_status,
    ) -> None:
        self.app = app
        self.pools = list(pools)
        self.period_s = period_s
        self.status = status
        self._problem: str | None = None

    def problem(self) -> str | None:
        """Why the app cannot serve now (None: it can), as of the last check."""
        return self._problem

    def check(self) -> None:
        """Ask the controller (blocking: call off the event loop)."""
        app = self.status().applications.get(self.app)
        deployments = {} if app is None else app.deployments
        dead = []
        for pool in self.pools:
            states = getattr(deployments.get(pool), "replica_states", {})
            if not any(str(getattr(s, "value", s)) == RUNNING and n > 0 for s, n in states.items()):
                dead.append(pool)
        self._problem = f"no live replica in the {' and '.join(dead)} pool" if dead else None

    async def run(self) -> None:
        """Check every `period_s` until cancelled; a failed check keeps the last verdict."""
        while True:
            try:
                await asyncio.to_thread(self.check)
            except Exception:  # noqa: BLE001 - keep watching; the next check may work
                logger.exception("reading the pools' status failed")
            await asyncio.sleep(self.period_s)
