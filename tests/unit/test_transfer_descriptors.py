"""Page ids to NIXL descriptors, peer records, and the transport's start-up error (no NIXL)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout
from workers.transfer import (
    KVTransferAgent,
    PageRun,
    PoolRegion,
    TransportUnavailableError,
    build_descriptors,
    merge_page_runs,
)
from workers.transfer.descriptors import count_descriptors
from workers.transfer.generations import generation_region
from workers.transfer.nixl_backend import backend_modules
from workers.transfer.peers import PeerRecord

PAGE = 1024
LOCAL = PoolRegion(base_addr=1_000_000, num_pages=64, page_bytes=PAGE, dev_id=0, mem_type="DRAM")
REMOTE = PoolRegion(base_addr=9_000_000, num_pages=32, page_bytes=PAGE, dev_id=1, mem_type="VRAM")


def naive_runs(local: list[int], remote: list[int]) -> list[PageRun]:
    runs: list[PageRun] = []
    for lp, rp in zip(local, remote, strict=True):
        last = runs[-1] if runs else None
        if last and lp == last.local_start + last.length and rp == last.remote_start + last.length:
            runs[-1] = PageRun(last.local_start, last.remote_start, last.length + 1)
        else:
            runs.append(PageRun(lp, rp, 1))
    return runs


def test_runs_merge_when_consecutive_on_both_sides() -> None:
    runs = merge_page_runs([10, 11, 12, 3], [5, 6, 7, 20])
    assert runs == [PageRun(10, 5, 3), PageRun(3, 20, 1)]


def test_run_breaks_when_only_the_remote_side_jumps() -> None:
    assert merge_page_runs([1, 2, 3, 4], [7, 8, 12, 13]) == [PageRun(1, 7, 2), PageRun(3, 12, 2)]


def test_run_breaks_when_only_the_local_side_jumps() -> None:
    assert merge_page_runs([1, 2, 9, 10], [7, 8, 9, 10]) == [PageRun(1, 7, 2), PageRun(9, 9, 2)]


def test_descending_pages_do_not_merge() -> None:
    assert len(merge_page_runs([7, 6, 5], [7, 6, 5])) == 3


def test_empty_and_single_page() -> None:
    assert merge_page_runs([], []) == []
    assert merge_page_runs([4], [9]) == [PageRun(4, 9, 1)]


def test_merge_matches_naive_loop_on_random_page_lists() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        # mostly ascending runs with occasional jumps, as the allocator hands them out
        local = np.cumsum(rng.choice([1, 1, 1, 2, 5], n)).tolist()
        remote = np.cumsum(rng.choice([1, 1, 1, 3], n)).tolist()
        assert merge_page_runs(local, remote) == naive_runs(local, remote)
        assert count_descriptors(local, remote) == len(naive_runs(local, remote))


def test_descriptors_cover_each_run_with_k_pages_of_bytes() -> None:
    local, remote = build_descriptors([10, 11, 12, 3], [5, 6, 7, 20], LOCAL, REMOTE)
    assert local.dtype == np.uint64 and local.shape == (2, 3)
    l0, r0 = LOCAL.base_addr, REMOTE.base_addr
    assert local.tolist() == [[l0 + 10 * PAGE, 3 * PAGE, 0], [l0 + 3 * PAGE, PAGE, 0]]
    assert remote.tolist() == [[r0 + 5 * PAGE, 3 * PAGE, 1], [r0 + 20 * PAGE, PAGE, 1]]


def test_one_contiguous_request_is_one_descriptor() -> None:
    local, remote = build_descriptors(list(range(1, 33)), list(range(0, 32)), LOCAL, REMOTE)
    assert local.tolist() == [[1_000_000 + PAGE, 32 * PAGE, 0]]
    assert remote.tolist() == [[9_000_000, 32 * PAGE, 1]]


def test_page_descs_have_one_row_per_page() -> None:
    rows = REMOTE.page_descs()
    assert rows.shape == (32, 3)
    assert rows[7].tolist() == [9_000_000 + 7 * PAGE, PAGE, 1]


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([1, 2], [1], "1 remote"),
        ([64], [0], "local page ids out of range"),
        ([0], [32], "remote page ids out of range"),
        ([-1], [0], "out of range"),
    ],
)
def test_bad_page_lists_are_refused(local: list[int], remote: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_descriptors(local, remote, LOCAL, REMOTE)


def test_page_bytes_must_match() -> None:
    other = PoolRegion(base_addr=0, num_pages=8, page_bytes=2 * PAGE, dev_id=0, mem_type="DRAM")
    with pytest.raises(ValueError, match="page bytes differ"):
        build_descriptors([1], [1], LOCAL, other)


def test_region_rejects_unknown_memory_type() -> None:
    with pytest.raises(ValueError, match="DRAM or VRAM"):
        PoolRegion(base_addr=0, num_pages=1, page_bytes=1, dev_id=0, mem_type="cuda")


@pytest.mark.parametrize("generations", [None, LOCAL])
def test_peer_record_round_trips_through_bytes(generations: PoolRegion | None) -> None:
    layout = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    record = PeerRecord("prefill-r0-rank0-abc", b"\x00\xffmeta", REMOTE, layout, generations)
    assert PeerRecord.from_bytes(record.to_bytes()) == record


def test_generation_region_has_one_8_byte_entry_per_page() -> None:
    gen = torch.zeros(64, dtype=torch.int64)
    region = generation_region(gen)
    assert (region.base_addr, region.num_pages, region.page_bytes) == (gen.data_ptr(), 64, 8)
    with pytest.raises(ValueError, match="int64"):
        generation_region(torch.zeros(64, dtype=torch.int32))


def test_missing_nixl_raises_transport_unavailable_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in backend_modules():
        monkeypatch.setitem(sys.modules, name, None)  # makes `import nixl_cuXX` fail
    layout = KVLayout(num_layers=1, page_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
    with pytest.raises(TransportUnavailableError, match="cannot import nixl"):
        KVTransferAgent(KVPool(layout, 4, "cpu"), "decode", "r0", 0, publish=False)
