"""The page allocator: runs of pages, the scratch page, generations, double frees."""

from __future__ import annotations

import pytest

from workers.kvcache.allocator import OutOfPagesError, PageAllocator


def test_fresh_allocations_are_ascending_runs_without_scratch_page() -> None:
    alloc = PageAllocator(10)
    assert alloc.allocate(3) == [1, 2, 3]
    assert alloc.allocate(2) == [4, 5]
    assert alloc.num_free == 4


def test_freed_pages_come_back_in_ascending_order() -> None:
    alloc = PageAllocator(10)
    pages = alloc.allocate(9)
    alloc.free([7, 5, 6])
    assert alloc.allocate(3) == [5, 6, 7]
    assert pages[0] == 1


def test_free_bumps_generation_and_rejects_double_free() -> None:
    alloc = PageAllocator(4)
    [p] = alloc.allocate(1)
    alloc.free([p])
    assert alloc.generation[p] == 1
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([p])
    with pytest.raises(ValueError):
        alloc.free([0])


def test_out_of_pages_names_the_shortfall() -> None:
    alloc = PageAllocator(4)
    with pytest.raises(OutOfPagesError, match="asked for 5"):
        alloc.allocate(5)
