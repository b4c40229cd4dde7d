"""The KV-event channel: one named Ray actor per application that every replica publishes its
cache changes to and every router replica reads them from.

Chosen by measurement over Ray's internal KV (what the stats board uses) and Serve's routing
stats (docs/architecture.md, "KV events"): a hub call carries a batch in one message and a reader
gets every batch since its cursor in one call, where the internal KV needs a key per batch and a
list plus a get per key to read them, and Serve's routing stats keep only each replica's latest
value (a delta in between is lost) and reach the routers no faster than their poll period.

The hub keeps a log of the last `LOG_BATCHES` batches, numbered, and each replica's current pages.
A reader passes the hub's epoch and its cursor; if it is new, fell behind the log, or the hub
restarted (new epoch), it gets a snapshot of every replica instead; a reader with nothing new
may wait up to `wait_s` for the next batch (a long poll: delivered at once, and an idle reader
calls once a second, not once a period). A publisher that sees a new epoch sends its whole
cache again (`KVEventPublisher`). Replicas silent for `FORGET_AFTER_S` (publishers send at
least an empty batch every `HEARTBEAT_S`) leave the snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.kvcache.kv_events import KVEventBatch

NAMESPACE = "pdserve"
LOG_BATCHES = 4096
HEARTBEAT_S = 5.0
FORGET_AFTER_S = 12 * HEARTBEAT_S


_readers: dict[str, Any] = {}  # app -> its hub's handle, for this process's reads


def hub_name(app: str) -> str:
    return f"kv-events/{app}"


@dataclass
class _Replica:
    pool: str
    incarnation: str
    pages: dict[int, int] = field(default_factory=dict)  # name -> tier (0: the device)
    seen: float = 0.0

    def snapshot(self, name: str) -> KVEventBatch:
        device = sorted(n for n, tier in self.pages.items() if tier == 0)
        lower = [(n, tier) for n, tier in self.pages.items() if tier]
        return KVEventBatch(name, self.incarnation, device, snapshot=True, offloaded=lower)


@dataclass
class KVEventRead:
    """What a reader gets: batches per pool since its cursor (or a snapshot) and where to go on."""

    epoch: str
    cursor: int
    batches: list[tuple[str, KVEventBatch]]
    snapshot: bool


class KVEventHub:
    """Plain class; `hub()` makes it a named, detached Ray actor."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self._log: deque[tuple[str, KVEventBatch]] = deque(maxlen=LOG_BATCHES)
        self._next = 0  # number of the next batch
        self._replicas: dict[str, _Replica] = {}
        self._logged = asyncio.Event()  # set, and replaced, when a batch enters the log

    async def publish(self, pool: str, batch: KVEventBatch) -> str:
        """Record `batch` of a replica of `pool`; answers the epoch."""
        now = time.monotonic()
        entry = self._replicas.get(batch.replica)
        if entry is None or entry.incarnation != batch.incarnation or batch.snapshot:
            entry = self._replicas[batch.replica] = _Replica(pool, batch.incarnation)
        entry.pages.update(dict.fromkeys(batch.stored, 0))
        entry.pages.update(batch.offloaded)  # (name, tier) pairs
        for page in batch.removed:
            entry.pages.pop(page, None)
        entry.seen = now
        if len(batch) or batch.snapshot:
            self._log.append((pool, batch))
            self._next += 1
            self._logged.set()
            self._logged = asyncio.Event()
        for name in [n for n, r in self._replicas.items() if now - r.seen > FORGET_AFTER_S]:
            del self._replicas[name]
        return self.epoch

    async def read(self, epoch: str, cursor: int, wait_s: float = 0.0) -> KVEventRead:
        """The batches since `cursor`; when there are none yet, the first to come within
        `wait_s`."""
        if wait_s > 0 and epoch == self.epoch and cursor == self._next:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._logged.wait(), wait_s)
        first = self._next - len(self._log)
        if epoch == self.epoch and first <= cursor <= self._next:
            batches = list(self._log)[cursor - first :]
            return KVEventRead(self.epoch, self._next, batches, snapshot=False)
        snapshot = [(r.pool, r.snapshot(name)) for name, r in self._replicas.items()]
        return KVEventRead(self.epoch, self._next, snapshot, snapshot=True)


def hub(app: str, create: bool) -> Any | None:
    """The hub actor of `app` (created if `create` and absent), None if there is none (yet) or
    outside Ray."""
    import ray

    if not ray.is_initialized():
        return None
    if not create:
        try:
            return ray.get_actor(hub_name(app), namespace=NAMESPACE)
        except ValueError:
            return None
    return (
        ray.remote(KVEventHub)
        .options(
            name=hub_name(app),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",  # its creator is a replica, which may die
            num_cpus=0,
            max_restarts=-1,
        )
        .remote()
    )


def read_kv_events(
    app: str, epoch: str, cursor: int, timeout_s: float, wait_s: float = 0.0
) -> KVEventRead | None:
    """The batches of `app`'s replicas since `cursor`, waiting up to `wait_s` for one when there
    are none (blocking: off the event loop); None while there is no hub."""
    import ray

    handle = _readers.get(app) or hub(app, create=False)
    if handle is None:
        return None
    try:
        result: KVEventRead = ray.get(handle.read.remote(epoch, cursor, wait_s), timeout=timeout_s)
    except Exception:
        _readers.pop(app, None)  # look the hub up again next time
        raise
    _readers[app] = handle
    return result
