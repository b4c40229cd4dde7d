"""Every replica's stats, posted to Ray's internal KV so a reader can sum a role's replicas.

A Serve handle (or a Prometheus scrape) reaches one replica per call, but /metrics must cover all
of them. Each replica posts its latest snapshot (any pydantic model: a worker's `EngineStats`, a
router's request metrics) at most once per `POST_INTERVAL_S` under `<app>/<role>/<replica>`;
readers take the entries of a role younger than `STALE_AFTER_S`, so a replica that died (and
stopped posting) drops out on its own.
"""

from __future__ import annotations

import json
import time
from typing import TypeVar

from pydantic import BaseModel

from workers.protocol import EngineStats
from workers.transfer.peers import ray_internal_kv

NAMESPACE = "pdserve-stats"
POST_INTERVAL_S = 1.0
STALE_AFTER_S = 15.0

ModelT = TypeVar("ModelT", bound=BaseModel)


class StatsPoster:
    """Called with each fresh snapshot (blocking: off the event loop); posts one a second at
    most. A no-op outside Ray."""

    def __init__(self, app: str, role: str, replica: str) -> None:
        self.key = f"{app}/{role}/{replica}"
        self._last = 0.0

    def __call__(self, stats: BaseModel) -> bool:
        """True when the snapshot was posted."""
        now = time.time()
        kv = ray_internal_kv()
        if kv is None or now - self._last < POST_INTERVAL_S:
            return False
        self._last = now
        body = json.dumps({"time": now, "stats": stats.model_dump(mode="json")}).encode()
        kv._internal_kv_put(self.key, body, overwrite=True, namespace=NAMESPACE)
        return True


def read_role(
    app: str, role: str, model: type[ModelT], now: float | None = None
) -> dict[str, ModelT]:
    """Replica -> its fresh snapshot, for every replica of `role` in `app` (blocking: call off
    the loop); empty outside Ray."""
    kv = ray_internal_kv()
    if kv is None:
        return {}
    now = time.time() if now is None else now
    prefix = f"{app}/{role}/"
    snapshots: dict[str, ModelT] = {}
    for key in kv._internal_kv_list(prefix, namespace=NAMESPACE):
        data = kv._internal_kv_get(key, namespace=NAMESPACE)
        if data is None:
            continue
        entry = json.loads(data)
        if now - entry["time"] < STALE_AFTER_S:
            name = key.decode() if isinstance(key, bytes) else key
            snapshots[name.removeprefix(prefix)] = model.model_validate(entry["stats"])
    return snapshots


def read_pool(app: str, role: str, now: float | None = None) -> list[EngineStats]:
    """The fresh engine snapshots of every replica of `role` in `app` (blocking)."""
    return list(read_role(app, role, EngineStats, now).values())
