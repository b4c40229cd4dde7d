"""A replica's side of the KV events: its radix cache's changes, sent to the hub in batches.

The engine loop thread calls `collect()` after each step (with the stats hook): it moves the
cache's net changes into an outbox. The publisher thread sends the outbox as one batch every
`period_s` (an empty one every `HEARTBEAT_S`, so the hub knows the replica lives), and the
whole cache as a snapshot when the hub answers a new epoch (it restarted, empty).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from workers.kvcache.kv_events import KVEventBatch, KVEventLog
from workers.kvcache.radix_cache import RadixCache
from workers.serve.kv_event_hub import HEARTBEAT_S, hub

logger = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self, app: str, pool: str, replica: str, radix: RadixCache, period_s: float
    ) -> None:
        self.app, self.pool, self.replica = app, pool, replica
        self.incarnation = uuid.uuid4().hex  # this process's cache: a restart starts empty
        self.period_s = period_s
        self.num_published = 0  # page events sent to the hub
        self._radix = radix
        radix.events = KVEventLog()
        self._outbox = KVEventLog()
        self._lock = threading.Lock()
        self._snapshot: KVEventBatch | None = None
        self._want_snapshot = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def collect(self) -> None:
        """On the engine loop thread (the only one touching the cache): take its changes."""
        assert self._radix.events is not None
        stored, removed, offloaded = self._radix.events.drain()
        snapshot = None
        if self._want_snapshot.is_set():
            snapshot = KVEventBatch(
                self.replica,
                self.incarnation,
                self._radix.page_names(),
                snapshot=True,
                offloaded=self._radix.lower_names(),
            )
        with self._lock:
            if snapshot is not None:
                self._want_snapshot.clear()
                self._snapshot, self._outbox = snapshot, KVEventLog()
            else:
                self._outbox.stored(stored)
                self._outbox.removed(removed)
                for name, tier in offloaded:
                    self._outbox.offloaded([name], tier)

    def close(self) -> None:
        self._stopped.set()

    def _next_batch(self) -> KVEventBatch:
        with self._lock:
            snapshot, self._snapshot = self._snapshot, None
            stored, removed, offloaded = self._outbox.drain()
        if snapshot is not None:
            return snapshot
        return KVEventBatch(self.replica, self.incarnation, stored, removed, offloaded=offloaded)

    def _run(self) -> None:
        import ray

        epoch, handle, last_sent = None, None, 0.0
        while not self._stopped.wait(self.period_s):
            batch = self._next_batch()
            if not len(batch) and not batch.snapshot and time.monotonic() - last_sent < HEARTBEAT_S:
                continue
            try:
                handle = handle or hub(self.app, create=True)
                if handle is None:
                    self._want_snapshot.set()  # this batch is lost: resync when there is one
                    continue
                answer = ray.get(handle.publish.remote(self.pool, batch), timeout=30)
            except Exception:  # noqa: BLE001 - the hub restarts; a snapshot then resyncs it
                logger.exception("publishing KV events failed")
                handle = None
                self._want_snapshot.set()
                continue
            last_sent = time.monotonic()
            self.num_published += len(batch)
            if epoch is not None and answer != epoch:
                self._want_snapshot.set()  # the hub restarted empty: send it everything
            epoch = answer
