"""Every replica's engine stats, posted to Ray's internal KV so the router can sum a pool.

A Serve handle reaches one replica per call, but /metrics must cover all of them. Each worker's
loop thread posts its latest `EngineStats` at most once per `POST_INTERVAL_S` under
`<app>/<role>/<replica>`; readers take the entries of a role younger than `STALE_AFTER_S`, so a
replica that died (and stopped posting) drops out on its own.
"""

from __future__ import annotations

import json
import time

from workers.engine_core import EngineStats
from workers.transfer.peers import ray_internal_kv

NAMESPACE = "pdserve-stats"
POST_INTERVAL_S = 1.0
STALE_AFTER_S = 15.0


class StatsPoster:
    """Called with each fresh snapshot on the loop thread; posts one a second at most."""

    def __init__(self, app: str, role: str, replica: str) -> None:
        self.key = f"{app}/{role}/{replica}"
        self._last = 0.0

    def __call__(self, stats: EngineStats) -> None:
        now = time.time()
        kv = ray_internal_kv()
        if kv is None or now - self._last < POST_INTERVAL_S:
            return
        self._last = now
        body = json.dumps({"time": now, "stats": stats.model_dump()}).encode()
        kv._internal_kv_put(self.key, body, overwrite=True, namespace=NAMESPACE)


def read_pool(app: str, role: str, now: float | None = None) -> list[EngineStats]:
    """The fresh snapshots of every replica of `role` in `app` (blocking: call off the loop)."""
    kv = ray_internal_kv()
    if kv is None:
        return []
    now = time.time() if now is None else now
    snapshots = []
    for key in kv._internal_kv_list(f"{app}/{role}/", namespace=NAMESPACE):
        data = kv._internal_kv_get(key, namespace=NAMESPACE)
        if data is None:
            continue
        entry = json.loads(data)
        if now - entry["time"] < STALE_AFTER_S:
            snapshots.append(EngineStats(**entry["stats"]))
    return snapshots
