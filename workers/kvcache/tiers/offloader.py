"""The tiers under the device pool: evicted pages go down (device -> host -> disk), prefix hits
come back up through asynchronous loads.

- `spill()` (called by the radix cache as it evicts, on the engine thread) copies pages into
  host memory, least recently used last in, the prefix's deeper pages the oldest. A full host
  tier first moves its least recently used page to disk (or drops it without one); a full disk
  tier deletes its oldest file. Pages are immutable once full, so a page is written to a tier
  once and later evictions of it only refresh its age there (write-back, no write-through).
- `lookup()` finds the pages that continue a device match, host before disk, page by page.
- `start()` queues an `OnloadJob` on the I/O thread: it reads host rows or files and copies them
  into device pages the job owns (on a GPU on its own stream, synchronised before the job counts
  as done), while the engine keeps stepping other requests. `poll()` hands finished jobs back.
Only the engine thread touches the indexes; the I/O thread reads and writes bytes. Entries a job
reads are pinned until it ends, and disk writes, reads and deletes run in order on one thread,
so a read of a page queued for writing finds its file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from workers.config import EngineConfig, KVOffloadConfig
from workers.kvcache.kv_events import KVEventLog
from workers.kvcache.pool import KVPool
from workers.kvcache.tiers.disk import DiskTier
from workers.kvcache.tiers.host import HostTier
from workers.kvcache.tiers.index import TierEntry

logger = logging.getLogger(__name__)
HOST, DISK = 1, 2  # tiers below the device (0), as KV events name them


@dataclass(eq=False)
class OnloadJob:
    owner: Any  # who waits for it (a sequence), or None once that one left
    node: Any  # the radix node locked for the device prefix the pages continue
    tokens: list[int]  # the prefix's tokens: device pages, then the loaded ones
    prefix_pages: list[int]
    pages: list[int]  # device pages the loads fill, owned by the job
    sources: list[tuple[int, TierEntry]]  # (tier, entry) per page, in order
    future: Future[tuple[int, float]] | None = None
    error: BaseException | None = None


class TieredStore:
    def __init__(
        self, pages: torch.Tensor, cfg: KVOffloadConfig, page_size: int, meta: dict[str, Any]
    ) -> None:
        self.raw = pages.view(torch.uint8).view(pages.shape[0], -1)  # a page a row, any dtype
        self.page_size = page_size
        self.page_bytes = self.raw.shape[1]
        self.cuda = self.raw.device.type == "cuda"
        self.host = HostTier(int(cfg.cpu_gb * 2**30) // self.page_bytes, self.page_bytes, self.cuda)
        self.disk = None
        if cfg.disk_dir is not None and cfg.disk_gb is not None:
            cap = int(cfg.disk_gb * 2**30) // self.page_bytes
            self.disk = DiskTier(cfg.disk_dir, cap, self.page_bytes, meta)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-tiers")
        self._copy = torch.cuda.Stream(self.raw.device) if self.cuda else None  # offloads
        self._load = torch.cuda.Stream(self.raw.device) if self.cuda else None  # onloads
        self._jobs: list[OnloadJob] = []
        self._writes: list[tuple[Future[None], TierEntry]] = []
        self._done = threading.Event()  # a job ended (wakes `wait`)
        self.on_device: Callable[[int], bool] = lambda name: False
        self.hit_tokens = {HOST: 0, DISK: 0}
        self.offload_bytes = self.onload_bytes = self.disk_write_bytes = 0
        self.onload_time_s = 0.0
        self.num_onloads = 0

    @classmethod
    def for_pool(
        cls, pool: KVPool, cfg: EngineConfig, model_dtype: torch.dtype, tp_rank: int = 0
    ) -> TieredStore | None:
        """The tiers `cfg.kv_offload` asks for under `pool` (None when off). Disk files are
        tagged with what makes their bytes this replica's: model, weights, dtypes, layout."""
        if cfg.kv_offload is None:
            return None
        layout = pool.layout
        meta = {
            "model": cfg.model,
            "weights": cfg.load_format if cfg.load_format == "auto" else f"dummy:{cfg.seed}",
            "model_dtype": str(model_dtype).removeprefix("torch."),
            "kv_dtype": layout.dtype,
            "kv_scales": [pool.scales.k, pool.scales.v],
            "page_size": layout.page_size,
            "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim],
            "kv_head_offset": layout.kv_head_offset,
            "tp_rank": tp_rank,
            "tp_size": cfg.tensor_parallel_size,
        }
        return cls(pool.pages, cfg.kv_offload, layout.page_size, meta)

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
                self._copy_down(slot, pages[i])  # now: a later page of this batch may demote it
            self.host.touch(entry)
            kept[i] = True
            if events is not None:
                events.offloaded([names[i]], HOST)
        return kept

    def _copy_down(self, slot: int, page: int) -> None:
        self.offload_bytes += self.page_bytes
        if self._copy is None:
            self.host.data[slot].copy_(self.raw[page])
            return
        compute = torch.cuda.current_stream(self.raw.device)
        self._copy.wait_stream(compute)  # the steps that wrote the page
        with torch.cuda.stream(self._copy):
            self.host.data[slot].copy_(self.raw[page], non_blocking=True)
        compute.wait_stream(self._copy)  # a step reusing the page waits for its copy

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
            if self._copy is not None:
                self._copy.synchronize()  # its row may still be arriving from the device
            data = self.host.data[entry.slot].clone()
            moved = TierEntry(entry.name, entry.parent, entry.tokens)
            disk.add(moved)
            self._writes.append((self._io.submit(disk.write, moved, data), moved))
            self.disk_write_bytes += self.page_bytes
            on_disk = True
        if events is not None and not self.on_device(entry.name):
            if on_disk:
                events.offloaded([entry.name], DISK)
            else:
                events.removed([entry.name])

    def _disk_room(self, disk: DiskTier, events: KVEventLog | None) -> bool:
        """Delete the oldest files until one more page fits; False if none can go."""
        while len(disk) >= disk.capacity:
            victim = next(disk.victims(), None)
            if victim is None:
                return False
            disk.remove(victim)
            self._io.submit(disk.delete, victim)
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
        for tier, entry in job.sources:
            (self.host if tier == HOST else self.disk).touch(entry)  # type: ignore[union-attr]
            self.hit_tokens[tier] += self.page_size
        job.future = self._io.submit(self._run, job)
        self._jobs.append(job)

    def _run(self, job: OnloadJob) -> tuple[int, float]:
        """On the I/O thread: fill the job's device pages; (bytes, seconds) it took."""
        start = time.perf_counter()
        try:
            if self._copy is not None:
                self._copy.synchronize()  # host rows still arriving from the device
            stream = torch.cuda.stream(self._load) if self._load is not None else nullcontext()
            with stream:
                for page, (tier, entry) in zip(job.pages, job.sources, strict=True):
                    disk = self.disk
                    src = (
                        self.host.data[entry.slot]
                        if disk is None or tier == HOST
                        else disk.read(entry)
                    )
                    self.raw[page].copy_(src, non_blocking=self.cuda)
            if self._load is not None:
                self._load.synchronize()
            return len(job.pages) * self.page_bytes, time.perf_counter() - start
        finally:
            self._done.set()

    def poll(self) -> list[OnloadJob]:
        """Jobs that ended since the last poll (a failed one has `error` set)."""
        self._writes = [w for w in self._writes if not self._write_done(*w)]
        ended = [j for j in self._jobs if j.future is not None and j.future.done()]
        if not ended:
            return []
        self._jobs = [j for j in self._jobs if j not in ended]
        for job in ended:
            self.unpin(job.sources)
            assert job.future is not None
            job.error = job.future.exception()
            if job.error is None:
                nbytes, seconds = job.future.result()
                self.onload_bytes += nbytes
                self.onload_time_s += seconds  # the copies' own time: the loads' bandwidth
                self.num_onloads += 1
            else:
                logger.error("loading KV pages from a lower tier failed: %s", job.error)
        return ended

    def _write_done(self, future: Future[None], entry: TierEntry) -> bool:
        if not future.done():
            return False
        if future.exception() is not None and self.disk is not None and entry.name in self.disk:
            logger.error("writing a KV page to disk failed: %s", future.exception())
            self.disk.remove(entry)
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until some job ends or `timeout_s` passes (when nothing else can run)."""
        if self._jobs:
            self._done.clear()
            if not any(j.future is not None and j.future.done() for j in self._jobs):
                self._done.wait(timeout_s)

    def disown(self, owner: object) -> None:
        """`owner` left: its jobs end unwatched (their pages still join the tree)."""
        for job in self._jobs:
            if job.owner is owner:
                job.owner = None

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
        """Wait for every queued write, delete and load (one thread runs them in order)."""
        self._io.submit(lambda: None).result()
