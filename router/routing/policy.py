"""Which replica gets a request: pure policies, free of Ray, fed by the Serve routers' hooks.

Prefill (`PrefixAwarePolicy`): a prompt costs, on replica r,
    cost(r) = uncached_tokens(r) + load_weight * pending_tokens(r)
where uncached_tokens(r) is the prompt minus the prefix `PrefixIndex` says r caches (from the
replicas' KV events, or guessed from what this router sent), and pending_tokens(r) the uncached
tokens of the prompts this router sent to r that have not come back yet: both are tokens to
compute, so cost(r) estimates the time to the first token on r (NVIDIA Dynamo's KV router weighs
prefill blocks against active blocks the same way): a prefill engine computes queued prompts
first come first served under a per-step token budget, so a new prompt waits for the pending
tokens ahead of it. Lowest cost ranks first.

The decision does not visit every replica: it walks the prompt's pages from the last one back,
costing only the replicas that hold a page (the index maps a page name to its holders), and stops
at the depth where even the least-loaded replica's load (`LoadBoard`, a heap) could no longer
beat the best cost found; the least-loaded replica itself is the candidate for an uncached
prompt. Among equally loaded idle replicas the hash ring of `LoadBoard.pick_least` decides by the
prompt's first page, so several routers send a new prefix to the same replica.

A request with a LoRA adapter adds `lora_miss_tokens` to the cost of each replica that does not
hold it (its routing stats' `lora_ids`: a device slot or a host copy), the work of loading it
there; the replicas holding it are costed too, so one of them wins unless another's cached
prefix or lighter load outweighs the miss.

Decode (`DecodeLoadPolicy`): fewest requests running first, then most free KV pages; a replica
whose last reported free pages cannot hold the request ranks after all that can, and one that
does not hold the request's adapter counts `lora_miss` more running requests.

Replica keys are any hashable with a stable `str()` (Serve's `ReplicaID`); a request key is any
string unique among requests in flight (Serve's internal request id).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from router.routing.loads import LoadBoard
from router.routing.prefix_index import PrefixIndex, uncached_tokens
from workers.api import GenerateRequest, KVEventBatch, page_hashes, prefix_cache_ids

R = TypeVar("R", bound=Hashable)  # a replica key (Serve's ReplicaID)


def cache_ids(req: GenerateRequest) -> Sequence[int]:
    """`req`'s prompt as the engines' prefix caches name its pages: by its LoRA adapter too
    (`prefix_cache_ids`); the same object for a base request, so its names are hashed once."""
    salt = getattr(req, "cache_salt", None)  # as `lora_id`: any request with a prompt
    return prefix_cache_ids(req.prompt_token_ids, lora_id(req), salt)


def lora_id(req: GenerateRequest) -> int:
    """`req`'s adapter's `lora_int_id`, 0 for the base model."""
    lora = getattr(req, "lora", None)  # Serve's routers see any request with a prompt
    return 0 if lora is None else lora.lora_int_id


def holds_lora(stats: Mapping[str, object], lora_int_id: int) -> bool:
    """Whether a replica's routing stats list the adapter (always, for the base model)."""
    held = stats.get("lora_ids", ())
    return not lora_int_id or (isinstance(held, Collection) and lora_int_id in held)


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


class PrefixAwarePolicy:
    def __init__(
        self,
        page_size: int,
        *,
        load_weight: float = 1.0,
        pages_per_replica: int | None = None,
        confirm_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        lora_miss_tokens: int = 256,
    ) -> None:
        """`pages_per_replica`: None for an index fed by the replicas' KV events (`apply()`),
        else the bound of an index that guesses from what this router sent."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.load_weight = load_weight
        self.lora_miss_tokens = lora_miss_tokens
        self.index = PrefixIndex(pages_per_replica, confirm_s, clock)
        self.in_flight = InFlight()
        self.loads: LoadBoard[Hashable] = LoadBoard()
        self._named: tuple[Sequence[int], list[int]] = ((), [])  # the last prompt hashed

    def rank(
        self, prompt: Sequence[int], lora_holders: Collection[Hashable] | None = None
    ) -> list[Hashable]:
        """The candidate replicas for `prompt`, best first: those holding a prefix that could
        beat the least-loaded replica, that one, and with `lora_holders` (the replicas holding
        the request's adapter; None for the base model) those. The first has the least cost
        over the whole pool (ties: the least-loaded replica the ring gives, then ring order)."""
        self.index.expire()
        least = self.loads.pick_least(self._salt(prompt))
        if least is None:
            return []
        names, n, w, ps = self._page_names(prompt), len(prompt), self.load_weight, self.page_size
        least_load, pick = least
        lora_miss = self.lora_miss_tokens

        def miss(r: Hashable) -> int:  # the adapter's load, where r does not hold it
            return 0 if lora_holders is None or r in lora_holders else lora_miss

        best = n + w * least_load + miss(pick)  # `pick`'s cost at most
        cost: dict[Hashable, float] = {}
        owners, loads, below = self.index.owners, self.loads, 0
        for i in range(len(names) - 1, -1, -1):
            uncached = n - min((i + 1) * ps, n - 1)  # uncached_tokens(n, i + 1), inlined
            if uncached + w * least_load > best:
                break  # no replica matching only pages 0..i can win
            holders = owners(names[i])
            if len(holders) == below:
                continue  # a holder of page i+1 holds page i: the same set, all costed
            below = len(holders)
            for r in holders:
                if r not in cost and r in loads:
                    lower = self.index.load_cost(names, i + 1, r) * ps  # tokens' worth of loads
                    cost[r] = c = uncached + lower + w * loads.get(r) + miss(r)
                    best = min(best, c)
        cost.setdefault(pick, n + w * least_load + miss(pick))
        for r in lora_holders or ():  # they may beat those the walk costed, which miss it
            if r not in cost and r in loads:
                depth = self.index.depth(names, r)
                lower = self.index.load_cost(names, depth, r) * ps
                cost[r] = self.uncached_tokens(n, depth) + lower + w * loads.get(r)
        return sorted(cost, key=lambda r: (cost[r], r != pick, loads.position(r)))

    def uncached_tokens(self, prompt_len: int, matched_pages: int) -> int:
        """Tokens to compute when `matched_pages` pages are cached (one token always is)."""
        return uncached_tokens(prompt_len, matched_pages, self.page_size)

    def routed(self, replica: Hashable, request: str, prompt: Sequence[int]) -> None:
        """`replica` accepted the request: it will cache the prompt's pages and is busier."""
        names = self._page_names(prompt)
        work = self.uncached_tokens(len(prompt), self.index.depth(names, replica))
        self.in_flight.add(replica, request, work)
        self.loads.set(replica, self.in_flight.work(replica))
        self.index.guess(replica, names)

    def completed(self, replica: Hashable, request: str) -> None:
        self.in_flight.remove(replica, request)
        self.loads.set(replica, self.in_flight.work(replica))

    def apply(self, batch: KVEventBatch) -> None:
        """A replica's KV events (an exact index only)."""
        self.index.apply(batch)

    def _page_names(self, prompt: Sequence[int]) -> list[int]:
        """`page_hashes(prompt)`, once for the rank and the routed of the same prompt object."""
        if self._named[0] is not prompt:
            self._named = (prompt, page_hashes(prompt, self.page_size))
        return self._named[1]

    def _salt(self, prompt: Sequence[int]) -> int:
        names = self._page_names(prompt)
        return names[0] if names else 0

    def forget(self, replica: Hashable) -> None:
        self.index.forget(replica)
        self.in_flight.forget(replica)
        self.loads.set(replica, 0)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Make `replicas` the pool (forgetting every replica not in it)."""
        for r in self.loads.retain(replicas) | (self.in_flight.replicas - self.loads.members):
            self.forget(r)


class DecodeLoadPolicy:
    def __init__(
        self, page_size: int, rng: random.Random | None = None, lora_miss: float = 2.0
    ) -> None:
        self.page_size = page_size
        self.lora_miss = lora_miss
        self.in_flight = InFlight()
        self._rng = rng or random.Random()

    def rank(
        self,
        replicas: Sequence[R],
        num_tokens: int,
        stats: Mapping[R, Mapping[str, float]],
        queue_lens: Mapping[R, int] | None = None,
        lora_int_id: int = 0,
    ) -> list[R]:
        """`replicas` best first for a request that will hold `num_tokens` tokens of KV, with
        the adapter `lora_int_id` (0: none). `stats`: each replica's last
        `record_routing_stats()` (num_running, kv_free_pages, lora_ids)."""
        pages = -(-num_tokens // self.page_size)

        def key(r: R) -> tuple[bool, float, float, float]:
            s = stats.get(r, {})
            pending = max(self.in_flight.count(r), (queue_lens or {}).get(r, 0))
            running, fits = decode_load(s, pending, pages)
            running += 0 if holds_lora(s, lora_int_id) else self.lora_miss
            return (not fits, running, -s.get("kv_free_pages", float("inf")), self._rng.random())

        return sorted(replicas, key=key)

    def routed(self, replica: Hashable, request: str) -> None:
        self.in_flight.add(replica, request, 1)

    def completed(self, replica: Hashable, request: str) -> None:
        self.in_flight.remove(replica, request)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        for r in self.in_flight.replicas - set(replicas):
            self.in_flight.forget(r)


def decode_load(stats: Mapping[str, float], pending: int, pages: int) -> tuple[float, bool]:
    """A decode replica's running requests (the most of `pending`, what the router counts there,
    and the replica's own `record_routing_stats()` report) and whether its last reported free
    KV pages hold `pages`."""
    running = max(pending, stats.get("num_running", 0))
    return running, stats.get("kv_free_pages", float("inf")) >= pages


def decode_load_order(
    ranked: Sequence[R],
    running: Mapping[R, float],
    fits: Mapping[R, bool],
    max_running_gap: int,
) -> list[R]:
    """Decode replicas `ranked` by the pages they hold (best first), reordered by their load:
    those whose free KV cannot hold the request (`fits` False) go last, and among the rest one
    running more than `max_running_gap` requests above the least busy loses its place to the
    others; the prefix order holds within each group."""
    least = min((running.get(r, 0) for r in ranked), default=0)
    return sorted(ranked, key=lambda r: (not fits.get(r, True),
                                         running.get(r, 0) > least + max_running_gap))  # fmt: skip
