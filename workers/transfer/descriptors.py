"""Page ids to NIXL transfer descriptors.

A KV pool is one contiguous tensor whose page p starts at `base_addr + p * page_bytes` and holds
every layer of that page (`workers/kvcache/pool.py`). A run of pages that is consecutive on
*both* sides (local page ids l, l+1, ... and remote page ids r, r+1, ...) is therefore one
contiguous byte range on each side, and moves as one descriptor of `k * page_bytes` bytes.

Invariants:
- `merge_page_runs` keeps the pairing: local page `local[i]` receives remote page `remote[i]`.
- A run breaks wherever either side's next page is not the previous one plus one.
- The local and remote descriptor arrays have the same length and the same length per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MemType = str  # "DRAM" or "VRAM", as NIXL names them


@dataclass(frozen=True)
class PageRun:
    """`length` pages: local `local_start + i` receives remote `remote_start + i`."""

    local_start: int
    remote_start: int
    length: int


@dataclass(frozen=True)
class PoolRegion:
    """Where one rank's KV pool lies in memory, as NIXL addresses it."""

    base_addr: int
    num_pages: int
    page_bytes: int
    dev_id: int
    mem_type: MemType

    def __post_init__(self) -> None:
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        if self.num_pages <= 0 or self.page_bytes <= 0:
            raise ValueError(f"empty pool region: {self}")

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def page_descs(self) -> np.ndarray:
        """One `(addr, page_bytes, dev_id)` row per page, in page-id order (for prepped dlists)."""
        addrs = self.base_addr + np.arange(self.num_pages, dtype=np.uint64) * np.uint64(
            self.page_bytes
        )
        return descriptor_rows(
            addrs, np.full(self.num_pages, self.page_bytes, np.uint64), self.dev_id
        )

    def run_descs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """`(addr, length * page_bytes, dev_id)` rows for runs starting at page `starts`."""
        pb = np.uint64(self.page_bytes)
        addrs = np.uint64(self.base_addr) + starts.astype(np.uint64) * pb
        return descriptor_rows(addrs, lengths.astype(np.uint64) * pb, self.dev_id)


def descriptor_rows(addrs: np.ndarray, lens: np.ndarray, dev_id: int) -> np.ndarray:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, lens, dev_id
    return out


def check_pages(pages: Sequence[int] | np.ndarray, num_pages: int, side: str) -> np.ndarray:
    """Page ids as an int64 array; raises if any lies outside `[0, num_pages)`."""
    arr = np.asarray(pages, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{side} page ids must be a flat list")
    if len(arr) and (arr.min() < 0 or arr.max() >= num_pages):
        raise ValueError(f"{side} page ids out of range [0, {num_pages}): {arr.tolist()}")
    return arr


def _run_bounds(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start index and length (into the page lists) of each run consecutive on both sides."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local pages but {len(remote)} remote pages")
    if len(local) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [len(local)])))
    return starts, lengths


def merge_page_runs(
    local_pages: Sequence[int] | np.ndarray, remote_pages: Sequence[int] | np.ndarray
) -> list[PageRun]:
    """Pair local and remote page ids and merge runs consecutive on both sides."""
    local = np.asarray(local_pages, dtype=np.int64)
    remote = np.asarray(remote_pages, dtype=np.int64)
    starts, lengths = _run_bounds(local, remote)
    return [
        PageRun(int(local[s]), int(remote[s]), int(n))
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
    ]


def count_descriptors(
    local_pages: Sequence[int] | np.ndarray, remote_pages: Sequence[int] | np.ndarray
) -> int:
    """How many descriptors `build_descriptors` makes for these pages (without making them)."""
    local = np.asarray(local_pages, dtype=np.int64)
    return len(_run_bounds(local, np.asarray(remote_pages, dtype=np.int64))[0])


def build_descriptors(
    local_pages: Sequence[int] | np.ndarray,
    remote_pages: Sequence[int] | np.ndarray,
    local: PoolRegion,
    remote: PoolRegion,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 `(addr, len, dev_id)` arrays for the local and the remote side, one row a run.

    Both pools must have the same `page_bytes` (the caller checks the layouts match).
    """
    if local.page_bytes != remote.page_bytes:
        raise ValueError(f"page bytes differ: local {local.page_bytes}, remote {remote.page_bytes}")
    lp = check_pages(local_pages, local.num_pages, "local")
    rp = check_pages(remote_pages, remote.num_pages, "remote")
    starts, lengths = _run_bounds(lp, rp)
    return local.run_descs(lp[starts], lengths), remote.run_descs(rp[starts], lengths)
