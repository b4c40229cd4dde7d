"""Engine replicas that load their engine once the application's router replica runs.

Serve starts every deployment's replicas at once. On a small machine the engines' loads
(torch, the weights, the KV pool) then slow the router's start several times over, and while
the router has no running replica Serve's proxy answers nothing, /health included: it holds the
request until a replica starts (router/health.py). Started first, the router answers /health
within milliseconds, 503 naming the pools still starting, for as long as the engines load.
The wait is bounded: an engine replica whose router does not come up within `INGRESS_WAIT_S`
loads anyway (a replacement replica finds the router running and does not wait at all).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from router.health import has_running
from workers.serve.decode import DecodeWorker
from workers.serve.prefill import PrefillWorker
from workers.serve.worker import replica_context

logger = logging.getLogger(__name__)

INGRESS = "router"  # the router's deployment name (cluster/app.py)
INGRESS_WAIT_S = 60.0
POLL_S = 0.25


def wait_for_ingress(app: str, wait_s: float = INGRESS_WAIT_S) -> bool:
    """Wait until application `app`'s router deployment has a running replica, at most
    `wait_s`; whether it has."""
    from ray import serve

    deadline = time.monotonic() + wait_s
    while True:
        status = serve.status().applications.get(app)
        if status is not None and has_running(status.deployments.get(INGRESS)):
            return True
        if time.monotonic() >= deadline:
            logger.warning("the router of %s is not running after %.0f s: loading the engine "
                           "anyway", app, wait_s)  # fmt: skip
            return False
        time.sleep(POLL_S)


class IngressFirst:
    """Mixed in before an engine worker: its constructor waits for the router, then loads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ctx = replica_context()
        if ctx is not None:
            wait_for_ingress(ctx.app_name)
        super().__init__(*args, **kwargs)


class DecodeReplica(IngressFirst, DecodeWorker):
    """The decode pool's replica of an application built by `build_app`."""


class PrefillReplica(IngressFirst, PrefillWorker):
    """The prefill pool's replica of an application built by `build_app`."""
