"""Heterogeneous TP hand-off without NIXL: which prefill ranks hold a decode rank's heads, and the
staged READ's descriptors, applied here as the memory copies NIXL would make between real pools."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout
from workers.transfer import KVLayoutMismatchError, PoolRegion
from workers.transfer.head_slices import (
    HeadSource,
    head_sources,
    is_direct,
    scatter_heads,
    staged_descriptors,
    staging_pages,
    staging_pages_needed,
)

HEADS = 4  # KV heads of the model


def layouts(tp: int, **kw: object) -> list[KVLayout]:
    per = HEADS // tp
    fields = dict(num_layers=3, page_size=4, head_dim=8, dtype="float32") | kw
    return [KVLayout(num_kv_heads=per, kv_head_offset=r * per, **fields) for r in range(tp)]  # type: ignore[arg-type]


def test_each_decode_rank_finds_the_prefill_ranks_holding_its_heads() -> None:
    p1, p2, p4 = layouts(1), layouts(2), layouts(4)
    assert head_sources(p2[1], p2) == [HeadSource(1, 2, 4)]  # equal TP: the same rank
    assert is_direct(p2[1], p2, head_sources(p2[1], p2))
    assert head_sources(p2[1], p1) == [HeadSource(0, 2, 4)]  # decode TP > prefill TP
    assert not is_direct(p2[1], p1, head_sources(p2[1], p1))
    assert head_sources(p1[0], p4) == [HeadSource(r, r, r + 1) for r in range(4)]
    assert head_sources(p2[0], p4) == [HeadSource(0, 0, 1), HeadSource(1, 1, 2)]


def test_pages_that_differ_in_more_than_their_heads_are_refused() -> None:
    with pytest.raises(KVLayoutMismatchError, match="head_dim"):
        head_sources(layouts(2)[0], layouts(1, head_dim=16))
    with pytest.raises(KVLayoutMismatchError, match="page_size"):
        head_sources(layouts(1)[0], layouts(2, page_size=8))
    with pytest.raises(KVLayoutMismatchError, match=r"heads \[2, 4\)"):
        head_sources(layouts(1)[0], layouts(2)[:1])  # a prefill rank missing


def test_spare_pages_cover_what_each_rank_stages() -> None:
    p1, p2 = layouts(1), layouts(2)
    assert staging_pages(5, p1[0], p2[0]) == 10  # a TP=1 page is two TP=2 pages
    assert staging_pages(5, p2[0], p1[0]) == 3  # two TP=2 pages fit one TP=1 page
    assert staging_pages_needed(p2, p2, 5) == 0  # direct
    assert staging_pages_needed(p2, p1, 5) == 10
    assert staging_pages_needed(p1, p2, 5) == 6  # two sources of three pages each


def region(pool: KVPool) -> PoolRegion:
    return PoolRegion(pool.pages.data_ptr(), pool.num_pages, pool.layout.page_bytes, 0, "DRAM")


def read_as_nixl(local_rows: np.ndarray, remote_rows: np.ndarray) -> None:
    """What a NIXL READ over these descriptor rows does: copy remote bytes into local ones."""
    assert (local_rows[:, 1] == remote_rows[:, 1]).all()
    for (dst, n, _), (src, _, _) in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
        ctypes.memmove(dst, src, n)


# FP8 and int8: pages moved as bytes; int8 rows carry their scales (head_dim + 4 bytes)
@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("spare_run", [True, False])  # read in place, or gathered first
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_a_staged_read_puts_every_head_where_the_decode_rank_keeps_it(
    prefill_tp: int, decode_tp: int, spare_run: bool, dtype: str
) -> None:
    gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp)
    prefill = [KVPool(lay, 16, "cpu") for lay in layouts(prefill_tp, dtype=dtype)]
    for pool in prefill:
        pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen) * 50)
    decode = [KVPool(lay, 40, "cpu") for lay in layouts(decode_tp, dtype=dtype)]
    remote_pages = [3, 4, 5, 9, 2]  # a run and two strays
    local_pages = [7, 8, 1, 2, 3]
    needed = staging_pages_needed([d.layout for d in decode], [p.layout for p in prefill], 5)
    spare = list(range(20, 20 + needed))
    if not spare_run:
        spare = spare[1::2] + spare[::2]
    for pool in decode:
        sources = head_sources(pool.layout, [p.layout for p in prefill])
        first = 0
        for s in sources:
            src = prefill[s.rank]
            n = staging_pages(len(remote_pages), src.layout, pool.layout)
            mine = spare[first : first + n]
            first += n
            rows = staged_descriptors(
                np.array(remote_pages), region(src), np.array(mine), region(pool)
            )
            read_as_nixl(*rows)
            scatter_heads(pool.pages, mine, local_pages, src.layout, pool.layout, s)
    # every decode rank now holds, in local page i, its heads of remote page i (compared as
    # bytes: [pages, L, 2, PS, HEADS, D * itemsize])
    whole = torch.cat([p.pages.view(torch.uint8) for p in prefill], dim=4)
    for pool in decode:
        lo, hi = pool.layout.kv_head_offset, pool.layout.kv_head_offset + pool.layout.num_kv_heads
        mine = pool.pages.view(torch.uint8)
        assert torch.equal(mine[local_pages], whole[remote_pages][..., lo:hi, :])
        untouched = [p for p in range(40) if p not in local_pages and p not in spare]
        assert not mine[untouched].any()


def test_descriptors_merge_where_both_sides_run_on() -> None:
    p1, p2 = layouts(1)[0], layouts(2)[0]
    remote = PoolRegion(10**6, 16, p1.page_bytes, 1, "DRAM")
    local = PoolRegion(10**8, 40, p2.page_bytes, 0, "DRAM")
    ld, rd = staged_descriptors(np.array([3, 4, 5]), remote, np.arange(10, 16), local)
    assert ld.tolist() == [[10**8 + 10 * p2.page_bytes, 3 * p1.page_bytes, 0]]  # one run
    assert rd.tolist() == [[10**6 + 3 * p1.page_bytes, 3 * p1.page_bytes, 1]]
    ld, rd = staged_descriptors(np.array([3, 9]), remote, np.array([10, 12, 13, 11]), local)
    assert ld[:, 1].sum() == rd[:, 1].sum() == 2 * p1.page_bytes and len(ld) == 4
    with pytest.raises(ValueError, match="cannot hold"):
        staged_descriptors(np.array([3, 4]), remote, np.array([10, 11, 12]), local)
