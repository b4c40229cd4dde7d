"""Heterogeneous TP hand-off: which prefill ranks hold a decode rank's KV heads, and moving them.

Each rank's pool holds the KV heads `[kv_head_offset, kv_head_offset + num_kv_heads)` of every
layer (`KVLayout`). With equal TP on both sides decode rank r holds exactly prefill rank r's heads
and reads its pages directly. Otherwise a decode rank's heads lie on one prefill rank that holds
more of them (decode TP > prefill TP) or on several that hold fewer (prefill TP > decode TP).

A page is `[num_layers, 2, page_size, heads, head_dim]`, so one rank's heads of a page are not
contiguous in another rank's page. Rather than one small descriptor per (layer, K/V, slot), a
decode rank reads each source rank's whole pages, end to end as raw bytes, into spare pages of its
own pool (`staged_descriptors`: descriptors of about a page each), then copies its heads into the
prompt's pages on its own device (`scatter_heads`). It reads `source heads / own heads` times the
bytes it keeps (2x for prefill TP 1 to decode TP 2), at the large-descriptor rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.protocol import KVLayout
from workers.transfer.descriptors import PoolRegion, descriptor_rows, merge_page_runs
from workers.transfer.errors import DTYPE_FIX, KVLayoutMismatchError

_SAME_MODEL = ("num_layers", "page_size", "head_dim", "dtype")


@dataclass(frozen=True)
class HeadSource:
    """Global KV heads `[start, stop)` of this rank come from prefill rank `rank`."""

    rank: int
    start: int
    stop: int


def head_sources(local: KVLayout, remote: Sequence[KVLayout]) -> list[HeadSource]:
    """The prefill ranks holding `local`'s heads, in head order. Raises KVLayoutMismatchError
    when the pages differ in more than their heads, or the prefill ranks lack some head."""
    for field in _SAME_MODEL:
        mine, theirs = getattr(local, field), {getattr(r, field) for r in remote}
        if theirs != {mine}:
            raise KVLayoutMismatchError(
                f"prefill KV pages differ in {field}: {sorted(map(str, theirs))} vs {mine} here"
                + (DTYPE_FIX if field == "dtype" else "")
            )
    lo, hi = local.kv_head_offset, local.kv_head_offset + local.num_kv_heads
    sources = []
    for rank, r in sorted(enumerate(remote), key=lambda item: item[1].kv_head_offset):
        start, stop = max(lo, r.kv_head_offset), min(hi, r.kv_head_offset + r.num_kv_heads)
        if start < stop:
            sources.append(HeadSource(rank, start, stop))
    covered = lo
    for s in sources:
        if s.start != covered:
            break
        covered = s.stop
    if covered != hi:
        raise KVLayoutMismatchError(f"the prefill ranks do not hold KV heads [{covered}, {hi})")
    return sources


def is_direct(local: KVLayout, remote: Sequence[KVLayout], sources: Sequence[HeadSource]) -> bool:
    """Whether one prefill rank holds exactly this rank's heads: its pages are read as they are."""
    return len(sources) == 1 and remote[sources[0].rank] == local


def staging_pages(num_pages: int, remote: KVLayout, local: KVLayout) -> int:
    """Local pages that hold `num_pages` pages of `remote`'s layout end to end."""
    return -(-num_pages * remote.page_bytes // local.page_bytes)


def staging_pages_needed(
    decode_layouts: Sequence[KVLayout], remote: Sequence[KVLayout], num_pages: int
) -> int:
    """Spare pages a read of `num_pages` prefill pages needs on every decode rank (ranks share
    page ids): the most any rank of `decode_layouts` stages; 0 when every rank reads directly."""
    need = 0
    for local in decode_layouts:
        sources = head_sources(local, remote)
        if not is_direct(local, remote, sources):
            pages = sum(staging_pages(num_pages, remote[s.rank], local) for s in sources)
            need = max(need, pages)
    return need


def staged_descriptors(
    remote_pages: np.ndarray, remote: PoolRegion, spare_pages: np.ndarray, local: PoolRegion
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 `(addr, len, dev_id)` rows, local and remote, that lay `remote_pages` end to end into
    `spare_pages` (the byte stream cut wherever a page of either side ends; rows contiguous on
    both sides merged)."""
    total = len(remote_pages) * remote.page_bytes
    if len(spare_pages) * local.page_bytes < total:
        raise ValueError(f"{len(spare_pages)} spare pages cannot hold {len(remote_pages)} pages")
    cuts = np.union1d(
        np.arange(0, total + 1, remote.page_bytes, dtype=np.int64),
        np.arange(0, total + 1, local.page_bytes, dtype=np.int64),
    )
    cuts = cuts[cuts <= total]
    starts, lens = cuts[:-1], np.diff(cuts)
    r_addr = remote.base_addr + remote_pages[starts // remote.page_bytes] * remote.page_bytes
    r_addr += starts % remote.page_bytes
    l_addr = local.base_addr + spare_pages[starts // local.page_bytes] * local.page_bytes
    l_addr += starts % local.page_bytes
    # a row continues the previous one where both sides' bytes follow on
    joins = (r_addr[1:] == r_addr[:-1] + lens[:-1]) & (l_addr[1:] == l_addr[:-1] + lens[:-1])
    first = np.concatenate(([True], ~joins))
    run = np.cumsum(first) - 1
    run_lens = np.bincount(run, weights=lens).astype(np.uint64)
    return (
        descriptor_rows(l_addr[first].astype(np.uint64), run_lens, local.dev_id),
        descriptor_rows(r_addr[first].astype(np.uint64), run_lens, remote.dev_id),
    )


def scatter_heads(
    pages: torch.Tensor,
    spare_pages: Sequence[int],
    local_pages: Sequence[int],
    remote: KVLayout,
    local: KVLayout,
    source: HeadSource,
) -> None:
    """Copy `source`'s heads out of the remote pages that `staged_descriptors` laid into
    `spare_pages` into `local_pages` of the pool `pages` ([num_pages, *one page]): one strided
    copy per run of consecutive local pages (on 2 CPU cores 5x faster than one indexed copy)."""
    if pages.element_size() == 1:  # FP8: moved as the bytes they are (any 1-byte dtype)
        pages = pages.view(torch.uint8)
    n = len(local_pages)
    shape = (n, remote.num_layers, 2, remote.page_size, remote.num_kv_heads, remote.row_width)
    spare = merge_page_runs(spare_pages, range(len(spare_pages)))
    if len(spare) == 1:  # as allocated on a pool without churn: read in place
        stream = pages[spare[0].local_start : spare[0].local_start + len(spare_pages)]
    else:
        stream = pages[torch.tensor(list(spare_pages), device=pages.device)]
    staged = stream.reshape(-1)[: n * remote.page_bytes // pages.element_size()].view(shape)
    src = slice(source.start - remote.kv_head_offset, source.stop - remote.kv_head_offset)
    dst = slice(source.start - local.kv_head_offset, source.stop - local.kv_head_offset)
    for run in merge_page_runs(local_pages, range(n)):
        i, j = run.remote_start, run.remote_start + run.length
        pages[run.local_start : run.local_start + run.length, ..., dst, :].copy_(
            staged[i:j, ..., src, :]
        )
