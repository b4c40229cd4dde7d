"""The router's guess of which replica caches which prompt prefix: chained page hashes, LRU.

A prompt is cut into whole pages of `page_size` tokens (the engine's radix cache holds only whole
pages). Page i is named by `hash((name of page i-1, its tokens))`, so one name stands for the whole
prefix that ends with that page (nano-vllm's chained block hashes). Names are plain Python hashes
of int tuples: the same in every process, whatever PYTHONHASHSEED says.

Invariants of `PrefixIndex`:
- `_pages[r]` is replica r's LRU of page names, oldest first, at most `pages_per_replica` long;
  `_owners[name]` is the set of replicas whose LRU holds `name`. The two always agree, and no
  owner set is empty.
- `insert()` touches a prompt's pages last page first, so a prefix is always at least as recent
  as any page that extends it, and eviction takes the deepest pages of the oldest prompts first,
  as the radix cache's leaf-first LRU does.
- `match()` counts a replica's leading pages only: a page whose parent was evicted never counts.
It is an approximation: it learns from what this router sent, not from the replicas' caches. It
misses what other routers (other ingress replicas) sent, and its per-replica bound only guesses a
replica's KV pool, so it may believe a prefix cached that the replica evicted, or the reverse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

_ROOT = 0x5EED


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained names of the whole pages of `token_ids`."""
    n = len(token_ids) // page_size
    names, prev = [], _ROOT
    for i in range(0, n * page_size, page_size):
        prev = hash((prev, *token_ids[i : i + page_size]))
        names.append(prev)
    return names


class PrefixIndex:
    def __init__(self, pages_per_replica: int) -> None:
        if pages_per_replica < 1:
            raise ValueError(f"pages_per_replica must be >= 1, got {pages_per_replica}")
        self.pages_per_replica = pages_per_replica
        self._pages: dict[Hashable, OrderedDict[int, None]] = {}
        self._owners: dict[int, set[Hashable]] = {}

    def __len__(self) -> int:
        """(page, replica) entries held, over all replicas."""
        return sum(len(lru) for lru in self._pages.values())

    def num_pages(self, replica: Hashable) -> int:
        lru = self._pages.get(replica)
        return 0 if lru is None else len(lru)

    @property
    def replicas(self) -> set[Hashable]:
        return set(self._pages)

    def match(self, names: Sequence[int], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Leading pages of `names` that each of `replicas` holds (0 for unknown replicas)."""
        matched = dict.fromkeys(replicas, 0)
        alive = {r for r in matched if r in self._pages}
        for i, name in enumerate(names):
            alive &= self._owners.get(name, set())
            if not alive:
                break
            for r in alive:
                matched[r] = i + 1
        return matched

    def insert(self, replica: Hashable, names: Sequence[int]) -> None:
        """Record that `replica` now caches the prefix ending at each of `names`."""
        lru = self._pages.setdefault(replica, OrderedDict())
        for name in reversed(names):
            if name in lru:
                lru.move_to_end(name)
            else:
                lru[name] = None
                self._owners.setdefault(name, set()).add(replica)
        while len(lru) > self.pages_per_replica:
            name, _ = lru.popitem(last=False)
            self._disown(name, replica)

    def forget(self, replica: Hashable) -> None:
        """Drop everything known about `replica` (it died or left the pool)."""
        for name in self._pages.pop(replica, ()):
            self._disown(name, replica)

    def _disown(self, name: int, replica: Hashable) -> None:
        owners = self._owners[name]
        owners.discard(replica)
        if not owners:
            del self._owners[name]

    def check_invariants(self) -> None:
        pairs = {(n, r) for r, lru in self._pages.items() for n in lru}
        assert pairs == {(n, r) for n, rs in self._owners.items() for r in rs}
        assert all(self._owners.values()), "empty owner set"
        assert all(len(lru) <= self.pages_per_replica for lru in self._pages.values())
