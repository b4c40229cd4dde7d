"""Every replica's stats, posted to Ray's internal KV so a reader can sum a role's replicas.

A Serve handle (or a Prometheus scrape) reaches one replica per call, but /metrics must cover all
of them. Each replica posts its latest snapshot (any pydantic model: a worker's `EngineStats`, a
router's request metrics) under `<app>/<role>/<replica>` about once per `POST_INTERVAL_S`: when
it has a new one, and from a heartbeat thread otherwise, so a replica busy in a long step still
posts and only a dead one stops. Readers get every entry of a role with `live` telling whether it
is younger than `STALE_AFTER_S`: a dead replica's gauges drop out within a few post periods,
while its last counters stay on the board, where every router replica finds them, so a role's
counter totals never go down when Serve replaces a replica. (The board keeps one entry per
replica that ever lived; posted times are compared across hosts, whose clocks must agree to
well under `STALE_AFTER_S`.)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from workers.engine_stats import EngineStats
from workers.ray_kv import ray_internal_kv

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve-stats"
POST_INTERVAL_S = 1.0
STALE_AFTER_S = 3 * POST_INTERVAL_S  # three missed heartbeats: dead, not merely slow

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class Posted(Generic[ModelT]):
    """A replica's last snapshot; `live` while the replica keeps posting."""

    stats: ModelT
    live: bool


def is_live(posted_at: float, now: float) -> bool:
    return now - posted_at < STALE_AFTER_S


class StatsPoster:
    """Called with each fresh snapshot (blocking: off the event loop); posts one a second at
    most, and the latest again every `POST_INTERVAL_S` from a heartbeat thread while no new one
    comes. A no-op outside Ray."""

    def __init__(
        self, app: str, role: str, replica: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.key = f"{app}/{role}/{replica}"
        self._clock = clock
        self._last = float("-inf")
        self._latest: BaseModel | None = None
        self._lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._stopped = threading.Event()

    def __call__(self, stats: BaseModel, force: bool = False) -> bool:
        """True when the snapshot was posted: when due, or at once with `force`."""
        with self._lock:
            self._latest = stats
            due = force or self._clock() - self._last >= POST_INTERVAL_S
        if ray_internal_kv() is None:
            return False
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name="stats-heartbeat",
                                               daemon=True)  # fmt: skip
            self._heartbeat.start()
        return due and self._post()

    def _post(self) -> bool:
        kv = ray_internal_kv()
        with self._lock:
            stats, now = self._latest, self._clock()
            if kv is None or stats is None:
                return False
            self._last = now
        body = json.dumps({"time": now, "stats": stats.model_dump(mode="json")}).encode()
        kv._internal_kv_put(self.key, body, overwrite=True, namespace=NAMESPACE)
        return True

    def close(self) -> None:
        """Stop the heartbeat (a replica's poster lives as long as its process)."""
        self._stopped.set()

    def _beat(self) -> None:
        while not self._stopped.wait(POST_INTERVAL_S):
            with self._lock:
                due = self._clock() - self._last >= POST_INTERVAL_S
            try:
                if due:
                    self._post()
            except Exception:  # noqa: BLE001 - the next beat may work
                logger.exception("posting stats to the board failed")


def read_role(
    app: str, role: str, model: type[ModelT], now: float | None = None
) -> dict[str, Posted[ModelT]]:
    """Replica -> its last snapshot, for every replica of `role` in `app` that posted, dead ones
    included (`live` False) (blocking: call off the loop); empty outside Ray."""
    kv = ray_internal_kv()
    if kv is None:
        return {}
    now = time.time() if now is None else now
    prefix = f"{app}/{role}/"
    snapshots: dict[str, Posted[ModelT]] = {}
    for key in kv._internal_kv_list(prefix, namespace=NAMESPACE):
        data = kv._internal_kv_get(key, namespace=NAMESPACE)
        if data is None:
            continue
        entry = json.loads(data)
        name = key.decode() if isinstance(key, bytes) else key
        stats = model.model_validate(entry["stats"])
        snapshots[name.removeprefix(prefix)] = Posted(stats, is_live(entry["time"], now))
    return snapshots


def read_pool(app: str, role: str, now: float | None = None) -> list[Posted[EngineStats]]:
    """The last engine snapshots of every replica of `role` in `app`, dead ones included."""
    return list(read_role(app, role, EngineStats, now).values())
