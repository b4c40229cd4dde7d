"""/health from memory: a background task asks Serve's controller which pools have a live replica.

/health must answer in milliseconds under any load and say 503 while a pool cannot serve; asking
the pools themselves (a handle call) queues behind their requests, and waits for ever when a
pool has no replica. So `PoolWatch.run()` reads `serve.status()` every `period_s` off the event
loop and /health answers with what it last saw. A replica that dies is RUNNING until the
controller notices (at its next health check, `health_check_period_s`). Until the first check
has answered, /health says 503 too: nothing is known to be up.

Before the router's own replica runs, nothing here answers: Serve's proxy holds a request for
a deployment without a running replica until one starts (no timeout, unless the Serve config's
`http_options.request_timeout_s` gives one: then 408). `cluster/startup.py` starts the engine
replicas after the router's, so that window is the router's own start, not the engines' too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RUNNING = "RUNNING"
NOT_CHECKED = "the pools' status has not been read yet"


def replica_counts(deployment: Any) -> dict[str, int]:
    """A deployment's replicas by state (`serve.status()`'s), e.g. {"STARTING": 1}."""
    states = getattr(deployment, "replica_states", None) or {}
    return {str(getattr(s, "value", s)): n for s, n in states.items() if n > 0}


def has_running(deployment: Any) -> bool:
    return replica_counts(deployment).get(RUNNING, 0) > 0


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
        self._problem: str | None = NOT_CHECKED

    def problem(self) -> str | None:
        """Why the app cannot serve now (None: it can), as of the last check."""
        return self._problem

    def check(self) -> None:
        """Ask the controller (blocking: call off the event loop)."""
        app = self.status().applications.get(self.app)
        deployments = {} if app is None else app.deployments
        dead = [p for p in self.pools if not has_running(deployments.get(p))]
        if not dead:
            self._problem = None
            return
        states = "; ".join(f"{p}: {replica_counts(deployments.get(p)) or 'none'}" for p in dead)
        self._problem = f"no live replica in the {' and '.join(dead)} pool ({states})"

    async def run(self) -> None:
        """Check every `period_s` until cancelled; a failed check keeps the last verdict."""
        while True:
            try:
                await asyncio.to_thread(self.check)
            except Exception:  # noqa: BLE001 - keep watching; the next check may work
                logger.exception("reading the pools' status failed")
            await asyncio.sleep(self.period_s)
