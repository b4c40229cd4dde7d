"""Which replica gets a request: pure policies, free of Ray, fed by the Serve routers' hooks.

Prefill (`PrefixAwarePolicy`): a prompt costs, on replica r,
    cost(r) = uncached_tokens(r) + load_weight * pending_tokens(r)
where uncached_tokens(r) is the prompt minus the prefix `PrefixIndex` believes r caches, and
pending_tokens(r) the uncached tokens of the prompts this router sent to r that have not come
back yet: both are tokens to compute, so cost(r) estimates the time to the first token on r
(NVIDIA Dynamo's KV router weighs prefill blocks against active blocks the same way): a prefill
engine computes queued prompts first come first served under a per-step token budget, so a new
prompt waits for the pending tokens ahead of it. Lowest cost ranks first. (Not counting pending
work below one step's budget was tried, and routed worse under load in bench/bench_routing.py.)

If the request counts of the replicas differ by more than `imbalance_threshold`, affinity is off
for that request and the least-loaded replica ranks first (the fallback of Ray's
PrefixCacheAffinityRouter and SGLang's cache_aware policy). Equal costs, as for a prompt no
replica has seen while all are idle, go by rendezvous hashing of the prompt's first page, so
several routers (one per ingress replica) send a new prefix to the same replica.

Decode (`DecodeLoadPolicy`): fewest requests running first, then most free KV pages; a replica
whose last reported free pages cannot hold the request ranks after all that can.

Replica keys are any hashable with a stable `str()` (Serve's `ReplicaID`); a request key is any
string unique among requests in flight (Serve's internal request id).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from router.routing.prefix_index import PrefixIndex, page_hashes


class InFlight:
    """Requests sent and not yet come back, per replica: how many, and their estimated work.

    Serve reports a completion and the routing it completes as two events on the router's loop,
    and a fast request's completion can come first. Such a completion is remembered (the last
    `early_limit` of them), and the routing it belongs to is then not counted: else the request
    would count as pending work on its replica for ever. A request rejected by a replica also
    completes without being routed there; if Serve then sends it to that same replica, it is
    not counted while it runs, an error that ends with the request.
    """

    def __init__(self, early_limit: int = 4096) -> None:
        self._requests: dict[str, tuple[Hashable, int]] = {}
        self._count: dict[Hashable, int] = {}
        self._work: dict[Hashable, int] = {}
        self._early: OrderedDict[tuple[Hashable, str], None] = OrderedDict()
        self._early_limit = early_limit

    def add(self, replica: Hashable, request: str, work: int) -> None:
        self._drop(request)  # a retried request is counted once, where it went last
        if (replica, request) in self._early:
            del self._early[(replica, request)]  # it has already come back
            return
        self._requests[request] = (replica, work)
        self._count[replica] = self._count.get(replica, 0) + 1
        self._work[replica] = self._work.get(replica, 0) + work

    def remove(self, replica: Hashable, request: str) -> None:
        """`request`, sent to `replica`, came back (answered, failed, rejected or cancelled)."""
        if self._requests.get(request, (None,))[0] == replica:
            self._drop(request)
            return
        self._early[(replica, request)] = None
        if len(self._early) > self._early_limit:
            self._early.popitem(last=False)

    def _drop(self, request: str) -> None:
        replica, work = self._requests.pop(request, (None, 0))
        if replica is None:
            return
        self._count[replica] -= 1
        self._work[replica] -= work
        if not self._count[replica]:
            del self._count[replica], self._work[replica]

    def forget(self, replica: Hashable) -> None:
        self._count.pop(replica, None)
        self._work.pop(replica, None)
        self._requests = {k: v for k, v in self._requests.items() if v[0] != replica}
        self._early = OrderedDict((k, None) for k in self._early if k[0] != replica)

    def count(self, replica: Hashable) -> int:
        return self._count.get(replica, 0)

    def work(self, replica: Hashable) -> int:
        return self._work.get(replica, 0)

    @property
    def replicas(self) -> set[Hashable]:
        return set(self._count)


def rendezvous(salt: int, replica: Hashable) -> int:
    """A stable pseudo-random rank of `replica` for `salt`: the same in every process."""
    digest = hashlib.blake2b(f"{salt}:{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


R = TypeVar("R", bound=Hashable)  # a replica key (Serve's ReplicaID)


class PrefixAwarePolicy:
    def __init__(
        self,
        page_size: int,
        *,
        load_weight: float = 1.0,
        imbalance_threshold: int = 8,
        pages_per_replica: int = 1 << 16,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.load_weight = load_weight
        self.imbalance_threshold = imbalance_threshold
        self.index = PrefixIndex(pages_per_replica)
        self.in_flight = InFlight()
        self._named: tuple[Sequence[int], list[int]] = ((), [])  # the last prompt hashed

    def rank(
        self,
        replicas: Sequence[R],
        prompt: Sequence[int],
        queue_lens: Mapping[R, int] | None = None,
    ) -> list[R]:
        """`replicas` best first. `queue_lens`: requests each replica reported running or
        queued (Serve's cache of them, which counts other routers' requests too)."""
        if not replicas:
            return []
        names = self._page_names(prompt)
        queued = {r: max(self.in_flight.count(r), (queue_lens or {}).get(r, 0)) for r in replicas}
        salt = names[0] if names else 0
        if max(queued.values()) - min(queued.values()) > self.imbalance_threshold:
            return sorted(
                replicas, key=lambda r: (queued[r], self.in_flight.work(r), rendezvous(salt, r))
            )
        matched = self.index.match(names, replicas)
        cost = {
            r: self.uncached_tokens(len(prompt), matched[r])
            + self.load_weight * self.in_flight.work(r)
            for r in replicas
        }
        return sorted(replicas, key=lambda r: (cost[r], rendezvous(salt, r)))

    def uncached_tokens(self, prompt_len: int, matched_pages: int) -> int:
        """Tokens to compute when `matched_pages` pages are cached (one token always is)."""
        return prompt_len - min(matched_pages * self.page_size, prompt_len - 1)

    def routed(self, replica: Hashable, request: str, prompt: Sequence[int]) -> None:
        """`replica` accepted the request: it will cache the prompt's pages and is busier."""
        names = self._page_names(prompt)
        matched = self.index.match(names, [replica])[replica]
        self.in_flight.add(replica, request, self.uncached_tokens(len(prompt), matched))
        self.index.insert(replica, names)

    def completed(self, replica: Hashable, request: str) -> None:
        self.in_flight.remove(replica, request)

    def _page_names(self, prompt: Sequence[int]) -> list[int]:
        """`page_hashes(prompt)`, once for the rank and the routed of the same prompt object."""
        if self._named[0] is not prompt:
            self._named = (prompt, page_hashes(prompt, self.page_size))
        return self._named[1]

    def forget(self, replica: Hashable) -> None:
        self.index.forget(replica)
        self.in_flight.forget(replica)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas` (the pool's current members)."""
        keep = set(replicas)
        for r in (self.index.replicas | self.in_flight.replicas) - keep:
            self.forget(r)


class DecodeLoadPolicy:
    def __init__(self, page_size: int, rng: random.Random | None = None) -> None:
        self.page_size = page_size
        self.in_flight = InFlight()
        self._rng = rng or random.Random()

    def rank(
        self,
        replicas: Sequence[R],
        num_tokens: int,
        stats: Mapping[R, Mapping[str, float]],
        queue_lens: Mapping[R, int] | None = None,
    ) -> list[R]:
        """`replicas` best first for a request that will hold `num_tokens` tokens of KV.
        `stats`: each replica's last `record_routing_stats()` (num_running, kv_free_pages)."""
        pages = -(-num_tokens // self.page_size)

        def key(r: R) -> tuple[bool, float, float, float]:
            s = stats.get(r, {})
            running = max(
                self.in_flight.count(r), (queue_lens or {}).get(r, 0), s.get("num_running", 0)
            )
            free = s.get("kv_free_pages", float("inf"))
            return (free < pages, running, -free, self._rng.random())

        return sorted(replicas, key=key)

    def routed(self, replica: Hashable, request: str) -> None:
        self.in_flight.add(replica, request, 1)

    def completed(self, replica: Hashable, request: str) -> None:
        self.in_flight.remove(replica, request)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        for r in self.in_flight.replicas - set(replicas):
            self.in_flight.forget(r)
