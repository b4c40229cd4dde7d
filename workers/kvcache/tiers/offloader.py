"""The tiers under the device pool: evicted pages go down (device -> host -> disk), prefix hits
come back up through asynchronous loads. This is the index and its decisions; the bytes move in
`TierData` (every TP rank has one and replays the same ops).

- `spill()` (called by the radix cache as it evicts, on the engine thread) copies pages into
  host memory, least recently used last in, the prefix's deeper pages the oldest. A full host
  tier first moves its least recently used page to disk (or drops it without one); a full disk
  tier deletes its oldest file. Pages are immutable once full, so a page is written to a tier
  once and later evictions of it only refresh its age there (write-back, no write-through).
- `lookup()` finds the pages that continue a device match, host before disk, page by page.
- `start()` queues an `OnloadJob`: each rank's I/O thread copies host rows or files into the
  device pages the job owns, while the engine keeps stepping other requests. `poll()` hands back
  the jobs every rank finished.
Entries a job reads are pinned until it ends.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.config import EngineConfig, KVOffloadConfig
from workers.kvcache.kv_events import KVEventLog
from workers.kvcache.pool import KVPool
from workers.kvcache.tiers.data import DISK, HOST, Delete, Demote, Down, LoadOp, TierData, TierOp
from workers.kvcache.tiers.disk import PageFiles
from workers.kvcache.tiers.host import HostTier
from workers.kvcache.tiers.index import TierEntry, TierIndex

logger = logging.getLogger(__name__)
__all__ = ["DISK", "HOST", "OnloadJob", "TieredStore"]


@dataclass(eq=False)
class OnloadJob:
    owner: Any  # who waits for it (a sequence), or None once that one left
    node: Any  # the radix node locked for the device prefix the pages continue
    tokens: list[int]  # the prefix's tokens: device pages, then the loaded ones
    prefix_pages: list[int]
    pages: list[int]  # device pages the loads fill, owned by the job
    sources: list[tuple[int, TierEntry]]  # (tier, entry) per page, in order
    key: int = 0
    waiting: int = 1  # ranks that have not finished it
    error: str | None = None
    nbytes: int = 0
    seconds: float = field(default=0.0)


def tier_meta(pool: KVPool, cfg: EngineConfig, model_dtype: torch.dtype, rank: int) -> dict:
    """What makes a rank's page bytes its own: model, weights, dtypes, scales, layout, rank."""
    layout = pool.layout
    return {
        "model": cfg.model,
        "weights": cfg.load_format if cfg.load_format == "auto" else f"dummy:{cfg.seed}",
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "kv_dtype": layout.dtype,
        "kv_scales": [pool.scales.k, pool.scales.v],
        "page_size": layout.page_size,
        "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim],
        "kv_head_offset": layout.kv_head_offset,
        "tp_rank": rank,
        "tp_size": cfg.tensor_parallel_size,
    }


def tier_data(pool: KVPool, cfg: KVOffloadConfig, meta: dict[str, Any]) -> TierData:
    """A rank's `TierData` for `cfg` under `pool`."""
    page_bytes = pool.layout.page_bytes
    files = None if cfg.disk_dir is None else PageFiles(cfg.disk_dir, page_bytes, meta)
    return TierData(pool.pages, int(cfg.cpu_gb * 2**30) // page_bytes, files)


class TieredStore:
    def __init__(
        self, data: TierData, page_size: int, disk_gb: float | None, peers: Any = None
    ) -> None:
        self.data = data
        self.peers = peers  # ranks 1..N-1 (`RankTiers`, tensor parallel): they replay every op
        self.page_size = page_size
        self.page_bytes = data.page_bytes
        self.host = HostTier(data.rows.shape[0], self.page_bytes)
        self.disk: TierIndex | None = None
        if data.files is not None and disk_gb is not None:
            self.disk = TierIndex(int(disk_gb * 2**30) // self.page_bytes)
            if self.disk.capacity < 1:
                mib = self.page_bytes / 2**20
                raise ValueError(f"kv_offload.disk_gb holds no page: a page is {mib:.2f} MiB")
            for entry in data.files.scan(self.disk.capacity):
                self.disk.add(entry)
        self._ops: list[TierOp] = []
        self._jobs: dict[int, OnloadJob] = {}
        self._keys = itertools.count()
        self.on_device: Callable[[int], bool] = lambda name: False
        self.hit_tokens = {HOST: 0, DISK: 0}
        self.offload_bytes = self.onload_bytes = self.disk_write_bytes = 0
        self.onload_time_s = 0.0
        self.num_onloads = 0

    @classmethod
    def for_pool(
        cls, pool: KVPool, cfg: EngineConfig, model_dtype: torch.dtype, peers: Any = None
    ) -> TieredStore | None:
        """The tiers `cfg.kv_offload` asks for under `pool` (None when off); `peers` replays
        the ops on ranks 1..N-1 under tensor parallelism (workers/engine/tier_ranks.py)."""
        off = cfg.kv_offload
        if off is None:
            return None
        data = tier_data(pool, off, tier_meta(pool, cfg, model_dtype, 0))
        return cls(data, pool.layout.page_size, off.disk_gb, peers)

    def _do(self, op: TierOp) -> None:
        self.data.apply([op])
        if self.peers is not None:
            self._ops.append(op)

    def _send(self) -> None:
        """Ranks 1..N-1 replay the ops so far (before the step that may reuse the pages)."""
        if self.peers is not None and self._ops:
            ops, self._ops = self._ops, []
            self.peers.apply(ops)

    # ---- down -------------------------------------------------------------------------------
    def spill(
        self,
        pages: list[int],
        names: list[int],
        tokens: list[int],
        parent: int,
        events: KVEventLog | None,
    ) -> list[bool]:
        """Keep evicted device `pages` (of `names`, `tokens`, after page `parent`) below; per
        page, whether some tier holds it now. Tier changes are reported to `events`."""
        ps, kept = self.page_size, [False] * len(pages)
        for i in range(len(pages) - 1, -1, -1):  # deepest first: it becomes the oldest
            key = (names[i], names[i - 1] if i else parent, tuple(tokens[i * ps : (i + 1) * ps]))
            entry = self.host.get(*key)
            if entry is None:
                slot = self._host_slot(events)
                if slot is None:
                    kept[i] = self.disk is not None and self.disk.get(*key) is not None
                    continue
                entry = TierEntry(*key, slot=slot)
                self.host.add(entry)
                self._do(Down(slot, pages[i]))  # now: a later page here may demote it
                self.offload_bytes += self.page_bytes
            self.host.touch(entry)
            kept[i] = True
            if events is not None:
                events.offloaded([names[i]], HOST)
        self._send()
        return kept

    def _host_slot(self, events: KVEventLog | None) -> int | None:
        """A free host row, moving the least recently used page down to make one."""
        slot = self.host.take_slot()
        if slot is not None:
            return slot
        for victim in self.host.victims():
            self.host.remove(victim)
            self._demote(victim, events)
            return victim.slot
        return None  # every row is being read

    def _demote(self, entry: TierEntry, events: KVEventLog | None) -> None:
        """`entry` left host memory: to disk if there is room, else it is dropped."""
        disk = self.disk
        on_disk = disk is not None and entry.name in disk
        if disk is not None and not on_disk and self._disk_room(disk, events):
            moved = TierEntry(entry.name, entry.parent, entry.tokens)
            disk.add(moved)
            self._do(Demote(entry.slot, moved))
            self.disk_write_bytes += self.page_bytes
            on_disk = True
        if events is not None and not self.on_device(entry.name):
            if on_disk:
                events.offloaded([entry.name], DISK)
            else:
                events.removed([entry.name])

    def _disk_room(self, disk: TierIndex, events: KVEventLog | None) -> bool:
        """Delete the oldest files until one more page fits; False if none can go."""
        while len(disk) >= disk.capacity:
            victim = next(disk.victims(), None)
            if victim is None:
                return False
            disk.remove(victim)
            self._do(Delete(victim))
            gone = victim.name not in self.host and not self.on_device(victim.name)
            if events is not None and gone:
                events.removed([victim.name])
        return True

    # ---- up ---------------------------------------------------------------------------------
    def lookup(
        self, token_ids: list[int], start: int, end: int, parent: int
    ) -> list[tuple[int, TierEntry]]:
        """The pages start..end-1 of `token_ids` (page `start - 1` named `parent`) that the
        tiers hold, as far as they hold them without a gap: (tier, entry) each."""
        ps, found = self.page_size, list[tuple[int, TierEntry]]()
        for i in range(start, end):
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            name = hash((parent, *tokens))  # page_hashes, one page at a time
            entry = self.host.get(name, parent, tokens)
            tier = HOST
            if entry is None and self.disk is not None:
                entry, tier = self.disk.get(name, parent, tokens), DISK
            if entry is None:
                break
            found.append((tier, entry))
            parent = name
        return found

    def pin(self, found: list[tuple[int, TierEntry]]) -> None:
        for _, entry in found:
            entry.pins += 1

    def unpin(self, found: list[tuple[int, TierEntry]]) -> None:
        for _, entry in found:
            entry.pins -= 1

    def start(self, job: OnloadJob) -> None:
        """Queue `job` (its sources pinned by `pin`, unpinned when it ends)."""
        for tier, entry in reversed(job.sources):  # deepest first: it stays the oldest
            (self.host if tier == HOST else self.disk).touch(entry)  # type: ignore[union-attr]
            self.hit_tokens[tier] += self.page_size
        job.key = next(self._keys)
        job.waiting = 1 + (0 if self.peers is None else self.peers.size)
        self._jobs[job.key] = job
        copies = tuple((p, t, e) for p, (t, e) in zip(job.pages, job.sources, strict=True))
        self._do(LoadOp(job.key, copies))
        self._send()

    def poll(self) -> list[OnloadJob]:
        """Jobs every rank finished since the last poll (a failed one has `error` set)."""
        if not self._jobs and not self.data.has_writes:
            return []
        results = [self.data.finished()]
        if self.peers is not None and self._jobs:
            results += self.peers.finished()
        for done, failed_writes in results:
            for entry in failed_writes:  # a rank lacks the file: no rank's copy is usable
                if self.disk is not None and self.disk.get(entry.name, entry.parent, entry.tokens):
                    self.disk.remove(self.disk.entries[entry.name])
            for key, result in done.items():
                job = self._jobs[key]
                job.waiting -= 1
                job.error = job.error or result.error
                job.nbytes += result.nbytes
                job.seconds = max(job.seconds, result.seconds)
        ended = [j for j in self._jobs.values() if j.waiting == 0]
        for job in ended:
            del self._jobs[job.key]
            self.unpin(job.sources)
            if job.error is None:
                self.onload_bytes += job.nbytes
                self.onload_time_s += job.seconds  # the copies' own time: the loads' bandwidth
                self.num_onloads += 1
            else:
                logger.error("loading KV pages from a lower tier failed: %s", job.error)
                self._forget_files(job.sources)
        return ended

    def _forget_files(self, sources: list[tuple[int, TierEntry]]) -> None:
        """A load failed: its disk pages are not trusted again (a file gone or torn)."""
        for tier, entry in sources:
            disk = self.disk
            gone = disk is not None and disk.entries.get(entry.name) is entry
            if tier == DISK and gone and entry.pins == 0:
                disk.remove(entry)  # type: ignore[union-attr]

    def wait(self, timeout_s: float) -> None:
        """Block until a job may have ended, at most `timeout_s` (when nothing else can run)."""
        if self._jobs:
            self.data.wait(timeout_s)

    def disown(self, owner: object) -> None:
        """`owner` left: its jobs end unwatched (their pages still join the tree)."""
        for job in self._jobs.values():
            if job.owner is owner:
                job.owner = None

    def is_loading_for(self, owner: object) -> bool:
        return any(job.owner is owner for job in self._jobs.values())

    @property
    def num_loading(self) -> int:
        return len(self._jobs)

    def names(self) -> list[tuple[int, int]]:
        """(name, tier) of every page below the device, its best tier (a snapshot)."""
        out = [(name, HOST) for name in self.host.entries]
        if self.disk is not None:
            out += [(n, DISK) for n in self.disk.entries if n not in self.host]
        return [(n, t) for n, t in out if not self.on_device(n)]

    def stats(self) -> dict[str, float]:
        disk = 0 if self.disk is None else len(self.disk)
        return {
            "kv_host_pages": len(self.host),
            "kv_host_bytes": len(self.host) * self.page_bytes,
            "kv_disk_pages": disk,
            "kv_disk_bytes": disk * self.page_bytes,
            "kv_host_hit_tokens": self.hit_tokens[HOST],
            "kv_disk_hit_tokens": self.hit_tokens[DISK],
            "kv_offload_bytes": self.offload_bytes,
            "kv_onload_bytes": self.onload_bytes,
            "kv_onload_time_s": self.onload_time_s,
            "kv_onloads": self.num_onloads,
        }

    def flush(self) -> None:
        """Wait for every queued write, delete and load, on every rank."""
        self.data.flush()
        if self.peers is not None:
            self.peers.flush()
