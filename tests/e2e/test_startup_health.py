"""/health while an application starts, through Serve and HTTP: once the router's replica runs
/health answers at once, 503 with a JSON body naming what is not running, until every pool has
a running replica. Before the router's replica runs Serve's proxy holds the request: that
window is not asserted (cluster/startup.py keeps it to the router's own start; how long the
engines then load depends on the machine, so the order is not asserted either)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from ray import serve

from cluster.app import build_app
from tests.e2e.conftest import HEALTHY_DEADLINE_S, local_args

PROBE_TIMEOUT_S = 2.0
SETTLE_S = 1.0  # from the controller's RUNNING to the proxy's routing table: a long poll
NAME = "startup"


def running(app: str) -> set[str]:
    """The deployments of `app` with a RUNNING replica."""
    status = serve.status().applications.get(app)
    deployments = {} if status is None else status.deployments
    return {
        name
        for name, d in deployments.items()
        if any(str(getattr(s, "value", s)) == "RUNNING" and n for s, n in d.replica_states.items())
    }


def test_health_answers_503_at_once_while_the_engines_load(serve_url: str) -> None:
    base = f"{serve_url}/{NAME}"
    serve.run(build_app(local_args("disaggregated")), name=NAME, route_prefix=f"/{NAME}",
              blocking=False)  # fmt: skip
    samples: list[tuple[float, set[str]]] = []  # (when, deployments running), every 0.1 s
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), running(NAME)))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    probes: list[tuple[float, int | None, Any]] = []  # (started, status, body)
    try:
        deadline = time.monotonic() + HEALTHY_DEADLINE_S
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                r = httpx.get(f"{base}/health", timeout=PROBE_TIMEOUT_S)
                probes.append((started, r.status_code, r.json() if r.status_code == 503 else None))
            except httpx.TimeoutException:
                probes.append((started, None, None))
            if probes[-1][1] == 200:
                break
            time.sleep(0.25)
    finally:
        done.set()
        sampler.join(5)
        serve.delete(NAME)
    assert probes and probes[-1][1] == 200, probes[-5:]
    router_ran = next((t for t, up in samples if "router" in up), None)
    assert router_ran is not None
    for started, status, body in probes[:-1]:
        if started >= router_ran + SETTLE_S:
            assert status == 503, (started - router_ran, status, body)  # never a hang
    for body in (body for _, status, body in probes if status == 503):
        message = body["error"]["message"]
        assert "no live replica in the" in message or "not been read yet" in message, message
