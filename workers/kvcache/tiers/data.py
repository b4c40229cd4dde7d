"""One rank's bytes of the KV tiers: its pool's pages, its host rows, its page files, its I/O
thread. The index (`TieredStore`, on rank 0) decides; each rank's `TierData` replays the same
`TierOp`s on its own shard (with tensor parallelism, rank 0 sends them as a `RankCommand`
before the next step, so a rank copies a page out before any step reuses it).

- `down`: a device page into a host row, on the engine thread (on a GPU on a copy stream that
  waits for the steps that wrote the page, and that the next step waits for).
- `demote`: a host row to a file: the row is copied at once (so it is free at once), the file
  written on the I/O thread; `delete` removes a file there too.
- `load`: host rows or files into device pages, on the I/O thread (on a GPU on its own stream,
  synchronised before the load counts as done), a run of consecutive pages as one copy;
  `finished` reports the loads that ended.
Writes, reads and deletes run in order on one thread, so a read of a page queued for writing
finds its file.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from workers.kvcache.pool import zeroed
from workers.kvcache.tiers.disk import PageFiles
from workers.kvcache.tiers.index import TierEntry

logger = logging.getLogger(__name__)
HOST, DISK = 1, 2  # tiers below the device (0), as KV events name them


@dataclass(frozen=True)
class Down:
    slot: int
    page: int


@dataclass(frozen=True)
class Demote:
    slot: int
    entry: TierEntry


@dataclass(frozen=True)
class Delete:
    entry: TierEntry


@dataclass(frozen=True)
class LoadOp:
    key: int  # the job's number
    copies: tuple[tuple[int, int, TierEntry], ...]  # (device page, tier, entry)


TierOp = Down | Demote | Delete | LoadOp


@dataclass
class LoadResult:
    error: str | None
    nbytes: int = 0
    seconds: float = 0.0  # the copies' own time (the loads' bandwidth), not their queueing


class TierData:
    def __init__(self, pages: torch.Tensor, host_rows: int, files: PageFiles | None) -> None:
        self.raw = pages.view(torch.uint8).view(pages.shape[0], -1)  # a page a row, any dtype
        self.page_bytes = self.raw.shape[1]
        self.cuda = self.raw.device.type == "cuda"
        shape = (host_rows, self.page_bytes)
        if self.cuda:
            self.rows = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        else:  # an anonymous map: costs nothing until pages arrive
            self.rows = zeroed(shape, torch.uint8, torch.device("cpu"))
        self.files = files
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-tiers")
        self._copy = torch.cuda.Stream(self.raw.device) if self.cuda else None
        self._load = torch.cuda.Stream(self.raw.device) if self.cuda else None
        self._arriving: dict[int, torch.cuda.Event] = {}  # GPU: host row -> its copy's end
        self._loads: dict[int, Future[LoadResult]] = {}
        self._writes: list[tuple[Future[None], TierEntry]] = []
        self._done = threading.Event()  # a load ended (wakes `wait`)

    def apply(self, ops: list[TierOp]) -> None:
        for op in ops:
            if isinstance(op, LoadOp):
                self._loads[op.key] = self._io.submit(self._run, op, self._fence())
            elif isinstance(op, Down):
                self._down(op.slot, op.page)
            elif isinstance(op, Demote):
                self._demote(op.slot, op.entry)
            else:
                assert self.files is not None
                self._io.submit(self.files.delete, op.entry)

    def _down(self, slot: int, page: int) -> None:
        if self._copy is None:
            self.rows[slot].copy_(self.raw[page])
            return
        compute = torch.cuda.current_stream(self.raw.device)
        self._copy.wait_stream(compute)  # the steps that wrote the page
        with torch.cuda.stream(self._copy):
            self.rows[slot].copy_(self.raw[page], non_blocking=True)
            self._arriving[slot] = torch.cuda.Event()
            self._arriving[slot].record()
        compute.wait_stream(self._copy)  # a step reusing the page waits for its copy

    def _fence(self) -> torch.cuda.Event | None:
        """GPU: an event after the work queued so far on the compute stream, which waits for
        every copy down (`_down`): a load's device pages may have been read by a step or by a
        copy down, or written by a step, until then; the load stream waits for it."""
        if self._copy is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.raw.device))
        return event

    def _row_ready(self, slot: int) -> None:
        """Wait until host row `slot`'s copy from the device is done (GPU; usually long since)."""
        event = self._arriving.get(slot)
        if event is not None:
            event.synchronize()

    def _demote(self, slot: int, entry: TierEntry) -> None:
        assert self.files is not None
        self._row_ready(slot)
        row = self.rows[slot].clone()
        self._writes.append((self._io.submit(self.files.write, entry, row), entry))

    def _run(self, op: LoadOp, fence: torch.cuda.Event | None) -> LoadResult:
        """On the I/O thread: fill the load's device pages, once `fence` (`_fence`) is passed.
        A run of consecutive device pages from consecutive host rows is one copy; disk pages are
        read into one pinned staging buffer first, whose runs are one copy each too. The fence
        implies every copy down queued before the load ended, so host rows are ready."""
        start = time.perf_counter()
        try:
            disk = [i for i, (_, tier, _) in enumerate(op.copies) if tier == DISK]
            staged = torch.empty((len(disk), self.page_bytes), dtype=torch.uint8,
                                 pin_memory=self.cuda and bool(disk))  # fmt: skip
            for row, i in enumerate(disk):
                assert self.files is not None
                self.files.read_into(op.copies[i][2], staged[row])
            read_s = time.perf_counter() - start
            staging_row = {i: row for row, i in enumerate(disk)}
            sources = [
                (page, self.rows, e.slot) if tier == HOST else (page, staged, staging_row[i])
                for i, (page, tier, e) in enumerate(op.copies)
            ]
            if self._load is None:
                start = time.perf_counter()
                for page, src, row, n in _runs(sources):
                    self.raw[page : page + n].copy_(src[row : row + n])
                return LoadResult(None, len(op.copies) * self.page_bytes,
                                  read_s + time.perf_counter() - start)  # fmt: skip
            began, ended = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            with torch.cuda.stream(self._load):
                if fence is not None:
                    self._load.wait_event(fence)
                began.record()
                for page, src, row, n in _runs(sources):
                    self.raw[page : page + n].copy_(src[row : row + n], non_blocking=True)
                ended.record()
            ended.synchronize()
            copy_s = began.elapsed_time(ended) / 1e3  # from the fence on: not a step's wait
            return LoadResult(None, len(op.copies) * self.page_bytes, read_s + copy_s)
        except Exception as e:  # noqa: BLE001 - reported; the pages are computed instead
            if self._load is not None:
                self._load.synchronize()  # the pages are freed next: no copy of ours lands after
            return LoadResult(f"{type(e).__name__}: {e}")
        finally:
            self._done.set()

    @property
    def has_writes(self) -> bool:
        return bool(self._writes)

    def finished(self) -> tuple[dict[int, LoadResult], list[TierEntry]]:
        """The loads that ended since the last call, and the pages whose file failed to write."""
        done = {k: f.result() for k, f in self._loads.items() if f.done()}
        for key in done:
            del self._loads[key]
        failed = [e for f, e in self._writes if f.done() and f.exception() is not None]
        for entry in failed:
            logger.error("writing a KV page to disk failed: %s", entry.name)
        self._writes = [(f, e) for f, e in self._writes if not f.done()]
        return done, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some load ends or `timeout_s` passes (when nothing else can run)."""
        self._done.clear()
        if self._loads and not any(f.done() for f in self._loads.values()):
            self._done.wait(timeout_s)

    def flush(self) -> None:
        """Wait for every queued write, delete and load."""
        self._io.submit(lambda: None).result()


def _runs(
    sources: list[tuple[int, torch.Tensor, int]],
) -> list[tuple[int, torch.Tensor, int, int]]:
    """(device page, source rows, row) per page -> (first page, rows, first row, length) per
    run of consecutive pages from consecutive rows of one source: one copy each."""
    runs: list[tuple[int, torch.Tensor, int, int]] = []
    for page, src, row in sources:
        if runs:
            p, s, r, n = runs[-1]
            if s is src and page == p + n and row == r + n:
                runs[-1] = (p, s, r, n + 1)
                continue
        runs.append((page, src, row, 1))
    return runs
