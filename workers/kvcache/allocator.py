"""Page allocator over one KV pool.

Invariants:
- Page 0 is the scratch page: never handed out. Padded or dummy tokens write their KV there.
- A page is either free (in `_free`) or owned by exactly one holder (a sequence or the radix
  cache); `free()` of a page that is already free raises.
- `generation[p]` grows by one each time page p is freed, so a reader that recorded it when the
  page was pinned can tell, after reading, whether the page was reused under it.
- Fresh pools hand out ascending runs, and freed pages are pushed so that they come back in
  ascending order: a request's pages tend to be consecutive, which merges NIXL descriptors.
"""

from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() gives 1, 2, 3, ...
        self._is_free = [True] * num_pages
        self._is_free[0] = False
        # A tensor, so a NIXL agent can register it and peers can read it (stale-read check).
        self.generation = torch.zeros(num_pages, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p] or p == 0:
                raise ValueError(f"page {p} freed twice (or scratch page)")
            self._is_free[p] = True
            self.generation[p] += 1
        self._free.extend(sorted(pages, reverse=True))
