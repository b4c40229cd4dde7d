"""A router process's reader of the KV events: one thread per application reads the hub (a long
poll: the hub answers when a batch comes, or after `WAIT_S` with none) and queues the batches
for every policy that subscribed to a pool.

Serve builds one request router per pool in each process that holds a handle (the ingress
replicas); each subscribes here, and applies its queue on its own loop before each decision
(`drain`), so the index is touched by one thread only. `index_pages()` is what
`pdserve:router_index_pages` reports: the (page, replica) entries each pool's index holds, per
tier of the replicas' KV (device, host, disk).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metric_names import Naming
from router.routing.prefix_index import TIERS
from workers.api import KVEventBatch, read_kv_events

logger = logging.getLogger(__name__)

WAIT_S = 1.0  # an idle reader's call rate; batches are answered at once either way
_feeds: dict[str, KVEventFeed] = {}
_feeds_lock = threading.Lock()


class KVEventFeed:
    def __init__(self, app: str, period_s: float) -> None:
        self.app, self.period_s = app, period_s
        self._queues: dict[str, list[queue.SimpleQueue[KVEventBatch]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.index_pages: dict[str, list[int]] = {}  # pool -> its index's entries per tier
        self._subscribed = 0  # subscriptions so far; a read for fewer must be a snapshot
        self.reads = 0  # reads answered by the hub and queued (a router lags one period)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, app: str, period_s: float) -> KVEventFeed:
        """This process's feed of `app` (started on first use)."""
        with _feeds_lock:
            if app not in _feeds:
                _feeds[app] = cls(app, period_s)
            return _feeds[app]

    def subscribe(self, pool: str) -> queue.SimpleQueue[KVEventBatch]:
        """A queue of `pool`'s batches from now on (a snapshot of every replica first)."""
        q: queue.SimpleQueue[KVEventBatch] = queue.SimpleQueue()
        with self._lock:
            self._queues[pool].append(q)
            self._subscribed += 1
        return q

    def close(self) -> None:
        """Stop reading, within one read's wait (a router's feed lives as long as its process; a
        test's must end before its process leaves Ray)."""
        with _feeds_lock:
            if _feeds.get(self.app) is self:
                del _feeds[self.app]
        self._stopped.set()
        self._thread.join(timeout=WAIT_S + 5)

    def _run(self) -> None:
        epoch, cursor, synced = "", 0, -1  # `synced`: subscriptions the last snapshot served
        while not self._stopped.is_set():
            with self._lock:
                subscribed = self._subscribed
            try:
                read = read_kv_events(self.app, epoch if synced == subscribed else "", cursor, 30,
                                      WAIT_S)  # fmt: skip
            except SystemExit:  # Ray's answer once this process has left it: nothing more to read
                return
            except Exception:  # noqa: BLE001 - the hub restarts; the next read resyncs
                if synced != -1:  # once per outage
                    logger.exception("reading KV events failed")
                read, synced = None, -1
            if read is not None:
                epoch, cursor = read.epoch, read.cursor
                synced = subscribed if read.snapshot else synced
                with self._lock:
                    for pool, batch in read.batches:
                        for q in self._queues.get(pool, ()):
                            q.put(batch)
                self.reads += 1  # once queued: a policy that sees the count can apply them
                if not read.batches:  # the wait ran out: read again at once
                    continue
            # after batches a period passes: the next read takes what came; without a hub (none
            # yet, or its application is gone while a handle's process lives on) a wait passes
            self._stopped.wait(self.period_s if read is not None else max(self.period_s, WAIT_S))


def close_feeds() -> None:
    """Stop every feed of this process. A process that leaves Ray (`ray.shutdown()`) must first:
    a feed's thread calling into Ray after that ends the process (Ray exits it, status 1)."""
    with _feeds_lock:
        feeds = list(_feeds.values())
    for feed in feeds:
        feed.close()


def feed_of(app: str) -> KVEventFeed | None:
    """This process's feed of `app`, if a router started one."""
    return _feeds.get(app)


def index_pages() -> dict[str, list[int]]:
    """Pool -> (page, replica) entries its router's index holds per tier (`TIERS`), over this
    process's feeds."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0] * len(TIERS))
    for feed in list(_feeds.values()):
        for pool, pages in list(feed.index_pages.items()):
            totals[pool] = [a + b for a, b in zip(totals[pool], pages, strict=True)]
    return dict(totals)


class IndexPagesCollector(Collector):
    """`router_index_pages{pool,tier}`: the (page, replica) entries this router's index holds."""

    def __init__(self, model_name: str, naming: Naming) -> None:
        self.model_name, self.naming = model_name, naming

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            self.naming("router_index_pages"),
            "(page, replica) entries of the router's KV index, from the replicas' KV events",
            labels=["model_name", "pool", "tier"],
        )
        for pool, per_tier in sorted(index_pages().items()):
            for tier, pages in zip(TIERS, per_tier, strict=True):
                family.add_metric([self.model_name, pool, tier], pages)
        yield family
