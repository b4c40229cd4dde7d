"""Which replica caches which prompt prefix: page name -> the replicas that hold it.

Pages are named by `page_hashes` (workers' KV events: the engine's radix cache names its pages
with the same function), so one name stands for the whole prefix that ends with that page.

Two ways to feed it:
- exact (`pages_per_replica=None`): `apply()` each replica's published `KVEventBatch`es. The
  index then holds what each replica's cache holds, up to the publishing delay; a batch with a
  new incarnation (a restarted replica) drops what was known of the old one first. A router's
  own sends are `guess()`ed at once (a burst of one prefix must not wait for the events) and
  dropped again if no event confirms them within `confirm_s`.
- approximate (`pages_per_replica=n`): only `guess()`, with an LRU of n pages per replica:
  what this router sent, blind to other routers, evictions and restarts.

Tiers: a replica with KV tiers (`EngineConfig.kv_offload`) reports pages its device pool evicted
to host memory (tier 1) or disk (tier 2) as offloaded; the index keeps each page's tier, and
`load_cost()` prices the lower-tier pages of a match at `TIER_COST` of a recompute each: a page
in host memory is worth far more than nothing, but less than one in HBM.

Invariants: `_pages[r]` (replica r's pages -> tier, LRU order, oldest first) and `_owners[name]`
always agree, no owner set is empty, and `tier_entries[t]` counts the entries in tier t. A cache
holds whole prefixes (the radix tree evicts leaves first; `guess()` touches a prompt's pages
last page first, so a prefix is never older than its extensions), so a replica holding page i
holds pages 0..i and the deepest page a replica holds is its match: `depth()` walks back from
the last page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from workers.api import KVEventBatch

_NONE: frozenset[Any] = frozenset()
TIERS = ("device", "host", "disk")
# A lower-tier page's load against its recompute, per token: an H200 prefills Llama-3-8B at
# ~20 us a token, and moves its KV (128 KiB a token in bf16) from pinned host memory at ~50
# GB/s (~2.6 us: 0.13) and from an NVMe disk at ~5 GB/s (~26 us: above 1, but a disk read
# queues behind no prefill; 0.5 keeps a disk hit ahead of a cold replica of equal load).
TIER_COST = (0.0, 0.15, 0.5)


def uncached_tokens(prompt_len: int, matched_pages: int, page_size: int) -> int:
    """Tokens of a prompt to compute when its first `matched_pages` pages are cached (one token
    always is: it gives the first output token's logits)."""
    return prompt_len - min(matched_pages * page_size, prompt_len - 1)


class PrefixIndex:
    def __init__(
        self,
        pages_per_replica: int | None = None,
        confirm_s: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if pages_per_replica is not None and pages_per_replica < 1:
            raise ValueError(f"pages_per_replica must be >= 1, got {pages_per_replica}")
        self.pages_per_replica = pages_per_replica
        self.confirm_s = confirm_s
        self._clock = clock
        self._pages: dict[Hashable, OrderedDict[int, int]] = {}
        self._owners: dict[int, set[Hashable]] = {}
        self._incarnation: dict[Hashable, str] = {}
        self._unconfirmed: OrderedDict[tuple[Hashable, int], float] = OrderedDict()
        self.num_entries = 0  # (page, replica) entries held, over all replicas
        self.tier_entries = [0] * len(TIERS)  # of which in each tier

    @property
    def exact(self) -> bool:
        return self.pages_per_replica is None

    def num_pages(self, replica: Hashable) -> int:
        lru = self._pages.get(replica)
        return 0 if lru is None else len(lru)

    @property
    def replicas(self) -> set[Hashable]:
        return set(self._pages)

    def owners(self, name: int) -> set[Hashable] | frozenset[Any]:
        return self._owners.get(name, _NONE)

    def depth(self, names: Sequence[int], replica: Hashable) -> int:
        """Leading pages of `names` that `replica` holds."""
        lru = self._pages.get(replica)
        if lru is None:
            return 0
        for i in range(len(names) - 1, -1, -1):
            if names[i] in lru:
                return i + 1
        return 0

    def load_cost(self, names: Sequence[int], depth: int, replica: Hashable) -> float:
        """The load cost, in tokens' recomputes a page, of the lower-tier pages among the first
        `depth` of `names` on `replica` (a cache evicts a prefix's deepest pages first, so they
        are the tail: the walk stops at the first page in HBM)."""
        lru, cost = self._pages.get(replica), 0.0
        for i in range(depth - 1, -1, -1):
            tier = 0 if lru is None else lru.get(names[i], 0)
            if tier == 0:
                break
            cost += TIER_COST[tier]
        return cost

    def guess(self, replica: Hashable, names: Sequence[int]) -> None:
        """`replica` was sent a prompt of these page names: it will soon cache them."""
        lru = self._pages.setdefault(replica, OrderedDict())
        deadline = None if self._clock is None else self._clock() + self.confirm_s
        for name in reversed(names):
            if name in lru:
                if not self.exact:
                    lru.move_to_end(name)  # LRU order matters only to the bounded guess
                continue
            self._add(replica, lru, name)
            if self.exact and deadline is not None:
                self._unconfirmed[(replica, name)] = deadline
        while self.pages_per_replica is not None and len(lru) > self.pages_per_replica:
            self._remove(replica, lru, next(iter(lru)))

    def apply(self, batch: KVEventBatch) -> None:
        """One replica's published cache changes."""
        replica = batch.replica
        if batch.snapshot or self._incarnation.get(replica, batch.incarnation) != batch.incarnation:
            self.forget(replica)
        self._incarnation[replica] = batch.incarnation
        lru = self._pages.setdefault(replica, OrderedDict())
        for name in batch.stored:
            self._unconfirmed.pop((replica, name), None)
            self._set_tier(replica, lru, name, 0)
        for name, tier in batch.offloaded:
            self._unconfirmed.pop((replica, name), None)
            self._set_tier(replica, lru, name, tier)
        for name in batch.removed:
            if name in lru:
                self._remove(replica, lru, name)

    def expire(self) -> None:
        """Drop guesses no event confirmed in time (the prompt never got cached there)."""
        now = None if self._clock is None else self._clock()
        while self._unconfirmed and now is not None:
            (replica, name), deadline = next(iter(self._unconfirmed.items()))
            if deadline > now:
                return
            del self._unconfirmed[(replica, name)]
            lru = self._pages.get(replica)
            if lru is not None and name in lru:
                self._remove(replica, lru, name)

    def forget(self, replica: Hashable) -> None:
        """Drop everything known about `replica` (it died, left the pool or restarted)."""
        for name, tier in self._pages.pop(replica, {}).items():
            self._disown(name, replica, tier)
        self._incarnation.pop(replica, None)
        stale = [key for key in self._unconfirmed if key[0] == replica]
        for key in stale:
            del self._unconfirmed[key]

    def _set_tier(
        self, replica: Hashable, lru: OrderedDict[int, int], name: int, tier: int
    ) -> None:
        old = lru.get(name)
        if old is None:
            self._add(replica, lru, name, tier)
        elif old != tier:
            lru[name] = tier
            self.tier_entries[old] -= 1
            self.tier_entries[tier] += 1

    def _add(self, replica: Hashable, lru: OrderedDict[int, int], name: int, tier: int = 0) -> None:
        lru[name] = tier
        self._owners.setdefault(name, set()).add(replica)
        self.num_entries += 1
        self.tier_entries[tier] += 1

    def _remove(self, replica: Hashable, lru: OrderedDict[int, int], name: int) -> None:
        self._disown(name, replica, lru.pop(name))

    def _disown(self, name: int, replica: Hashable, tier: int) -> None:
        owners = self._owners[name]
        owners.discard(replica)
        self.num_entries -= 1
        self.tier_entries[tier] -= 1
        if not owners:
            del self._owners[name]

    def check_invariants(self) -> None:
        pairs = {(n, r) for r, lru in self._pages.items() for n in lru}
        assert pairs == {(n, r) for n, rs in self._owners.items() for r in rs}
        assert len(pairs) == self.num_entries == sum(self.tier_entries)
        tiers = [0] * len(TIERS)
        for lru in self._pages.values():
            for tier in lru.values():
                tiers[tier] += 1
        assert tiers == self.tier_entries
        assert all(self._owners.values()), "empty owner set"
        if self.pages_per_replica is not None:
            assert all(len(lru) <= self.pages_per_replica for lru in self._pages.values())
