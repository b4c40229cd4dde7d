"""The pool's members and their loads, kept so that a routing decision need not visit them all.

`LoadBoard.least()` answers the least load in O(log n) amortised (a heap with stale entries,
skipped when popped), and `pick_least(salt)` which least-loaded replica a new prefix goes to:
the first one clockwise from `salt` on a hash ring of the members, so that every router sends
the same new prefix to the same idle replica and different prefixes spread over the pool
(rendezvous hashing's property, without hashing every replica per request).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)  # a replica key (Serve's ReplicaID)

RING_WALK = 64  # ring steps before `pick_least` settles for the heap's least-loaded replica
POINTS = 64  # ring points per replica: with one, a replica's share of new prefixes is uneven


def ring_position(replica: Hashable) -> int:
    """A stable pseudo-random position of `replica`: the same in every process."""
    return int.from_bytes(hashlib.blake2b(str(replica).encode(), digest_size=8).digest(), "little")


class LoadBoard(Generic[R]):
    def __init__(self) -> None:
        self._load: dict[R, int] = {}
        self._heap: list[tuple[int, int, R]] = []  # (load, ring position, replica), some stale
        self._ring: list[tuple[int, R]] = []  # (position, replica), POINTS a replica
        self._pos: dict[R, int] = {}

    def __contains__(self, replica: object) -> bool:
        return replica in self._load

    def __len__(self) -> int:
        return len(self._load)

    @property
    def members(self) -> set[R]:
        return set(self._load)

    def retain(self, replicas: Iterable[R]) -> set[R]:
        """Make `replicas` the members (new ones at load 0); return the members dropped."""
        keep = set(replicas)
        gone = set(self._load) - keep
        for r in gone:
            del self._load[r], self._pos[r]
        for r in keep - set(self._load):
            self._pos[r] = ring_position(r)
            self.set(r, 0)
        if gone or len(self._ring) != POINTS * len(keep):
            points = ((ring_position((r, k)), r) for r in self._load for k in range(POINTS))
            self._ring = sorted(points, key=lambda point: point[0])
            self._rebuild()
        return gone

    def position(self, replica: R) -> int:
        """`replica`'s stable tie-break rank (its ring position)."""
        return self._pos.get(replica, 0)

    def get(self, replica: R) -> int:
        return self._load.get(replica, 0)

    def set(self, replica: R, load: int) -> None:
        if replica not in self._pos:
            return  # not a member (yet)
        self._load[replica] = load
        heapq.heappush(self._heap, (load, self._pos[replica], replica))
        if len(self._heap) > 4 * len(self._load) + 64:
            self._rebuild()

    def least(self) -> tuple[int, R] | None:
        """(load, replica) of a least-loaded member, None for an empty pool."""
        while self._heap:
            load, _, r = self._heap[0]
            if self._load.get(r) == load:
                return load, r
            heapq.heappop(self._heap)
        return None

    def pick_least(self, salt: int) -> tuple[int, R] | None:
        """A least-loaded member: the first clockwise from `salt` within `RING_WALK` steps,
        else the heap's."""
        least = self.least()
        if least is None:
            return None
        n = len(self._ring)
        start = bisect.bisect_left(self._ring, ring_position(salt), key=lambda p: p[0])
        for step in range(min(n, RING_WALK)):
            r = self._ring[(start + step) % n][1]
            if self._load[r] == least[0]:
                return least[0], r
        return least

    def _rebuild(self) -> None:
        self._heap = [(load, self._pos[r], r) for r, load in self._load.items()]
        heapq.heapify(self._heap)
