"""Ray Serve request routers (alpha API, Ray >= 2.49) that apply `router.routing.policy`.

`cluster/app.py` names them in a pool's `request_router_config`; every DeploymentHandle to that
pool (the ingress replicas hold them) then builds one router per process, and Serve calls:
- `choose_replicas()` per attempt to route a request: we answer singleton ranks, best first, and
  Serve takes the first whose queue is below `max_ongoing_requests` (probing when unsure);
- `on_request_routed()` when a replica accepted it, `on_request_completed()` when it finished
  (also for an accepted-then-failed request, and without a prior `on_request_routed()` when the
  replica rejected it; for a fast request, sometimes before its `on_request_routed()`: the
  policy's `InFlight` sorts that out);
- `update_replicas()` when the pool's membership changes and `on_replica_actor_died()` when a
  call found a replica dead: both make the policy forget what it knew of the replicas gone.
A replica whose engine died (posted on the stats board, `DeadReplicas`) is no candidate from the
moment it is read, before Serve's health check replaces it; with every replica dead a decode
call waits for a live one (Serve backs off), a prefill call goes to a dead one and fails at
once, so the decode replica prefills instead (`DisaggregatedBackend._prefill`).
Calls other than `prefill` / `generate` (stats, release) carry no prompt: all replicas form one
rank and Serve picks the one with the shortest queue.

Limits: the policy learns of a request when a replica accepts it, so requests routed at the same
moment all see the same state (a burst of one prefix lands on one replica, up to its
`max_ongoing_requests`); and a caller can see its result before `on_request_completed()` runs, so
a follow-up sent at once may still count its predecessor as pending work on that replica.

Serve pickles this module by value into each process that holds a handle; the policies it imports
are imported there by name, so `router` must be importable wherever the ingress runs.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.routing.dead_replicas import DeadReplicas
from router.routing.kv_feed import KVEventFeed
from router.routing.policy import (
    DecodeLoadPolicy,
    PrefixAwarePolicy,
    cache_ids,
    decode_load,
    decode_load_order,
    holds_lora,
    lora_id,
)

logger = logging.getLogger(__name__)


def _request_of(pending: PendingRequest | None) -> Any | None:
    """The `GenerateRequest` a `prefill(req)` / `generate(req, first)` call carries, else None."""
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    return req if hasattr(req, "prompt_token_ids") else None


def kv_tokens(req: Any) -> int:
    """The KV tokens a decode of `req` holds at most: its prompt and every token it may add."""
    return len(req.prompt_token_ids) + req.params.max_tokens


class _PolicyRouter(RequestRouter):
    """What both routers share: a policy that tracks in-flight requests and live replicas."""

    policy: PrefixAwarePolicy | DecodeLoadPolicy
    _dead: DeadReplicas | None = None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when all are full
        candidate_replicas = self._live(candidate_replicas)
        if not candidate_replicas:
            return []
        req = _request_of(pending_request)
        if req is None:
            return [candidate_replicas]
        return self.rank(req, candidate_replicas)

    def rank(self, req: Any, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Serve's ranks of `candidates` for the request `req`, best first."""
        raise NotImplementedError

    def _live(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """`candidates` without the replicas whose engine died; all of them for a prefill
        call when every one did (it fails at once: the decode replica prefills instead)."""
        if self._dead is None:
            self._dead = DeadReplicas.of(self._deployment_id.app_name, self._deployment_id.name)
        dead = self._dead.dead()
        live = [r for r in candidates if r.replica_id.unique_id not in dead]
        if not live and self._deployment_id.name == "prefill":
            return candidates
        return live

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id.unique_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.retain(r.replica_id.unique_id for r in replicas)


class PrefillRouter(_PolicyRouter):
    """Longest cached prefix weighed against pending prefill work (`PrefixAwarePolicy`), on an
    index fed by the pool's KV events (`kv_events_period_s` > 0) or guessed from what it sent;
    a replica whose routing stats do not list the request's adapter costs `lora_miss_tokens`.
    Replicas are keyed by `ReplicaID.unique_id`, the name they publish their events under."""

    policy: PrefixAwarePolicy

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self,
        page_size: int = 16,
        load_weight: float = 1.0,
        pages_per_replica: int = 1 << 16,
        kv_events_period_s: float = 0.0,
        lora_miss_tokens: int = 256,
    ) -> None:
        exact = kv_events_period_s > 0
        self.policy = PrefixAwarePolicy(
            page_size,
            load_weight=load_weight,
            pages_per_replica=None if exact else pages_per_replica,
            lora_miss_tokens=lora_miss_tokens,
        )
        self._pool = self._deployment_id.name
        self._feed = (
            KVEventFeed.of(self._deployment_id.app_name, kv_events_period_s) if exact else None
        )
        self._events = None if self._feed is None else self._feed.subscribe(self._pool)
        self._gone: set[str] = set()  # replicas dead or removed: their late events are dropped

    def rank(self, req: Any, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        self._apply_events()
        by_id = {r.replica_id.unique_id: r for r in candidates}
        lora = lora_id(req)
        holders = {k for k, r in by_id.items() if holds_lora(r.routing_stats or {}, lora)}
        best = [by_id[k] for k in self.policy.rank(cache_ids(req), holders if lora else None)
                if k in by_id]  # fmt: skip
        chosen = {r.replica_id for r in best}
        rest = [r for r in candidates if r.replica_id not in chosen]
        return [[r] for r in best] + ([rest] if rest else [])

    def _apply_events(self) -> None:
        if self._events is None or self._feed is None:
            return
        while not self._events.empty():
            batch = self._events.get_nowait()
            if batch.replica not in self._gone:
                self.policy.apply(batch)
        self._feed.index_pages[self._pool] = list(self.policy.index.tier_entries)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        req = _request_of(pending_request)
        if req is not None:
            request = pending_request.metadata.internal_request_id
            self.policy.routed(replica_id.unique_id, request, cache_ids(req))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        self._gone |= {rid.unique_id for rid in gone}
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._gone.add(replica_id.unique_id)
        self.policy.retain(rid.unique_id for rid in self._replicas)  # forgets the dead one
        logger.info("prefix router: forgot dead replica %s", replica_id)


class DecodePrefixRouter(PrefillRouter):
    """Decode pool with `decode_prefix_aware`: the prefix policy's order (the pages each replica
    holds, from its KV events, against pending work), then each replica's own load from its
    routing stats (`decode_load_order`): running requests and free KV pages."""

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self, max_running_gap: int = 8, **prefix: Any
    ) -> None:
        super().initialize_state(**prefix)
        self._max_running_gap = max_running_gap
        self._page_size = self.policy.page_size

    def rank(self, req: Any, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        ordered = [r for rank in super().rank(req, candidates) for r in rank]
        cache = self.replica_queue_len_cache
        running, fits = {}, {}
        pages = -(-kv_tokens(req) // self._page_size)
        for r in ordered:
            pending = max(self.policy.in_flight.count(r.replica_id.unique_id),
                          cache.get(r.replica_id) or 0)  # fmt: skip
            running[r], fits[r] = decode_load(r.routing_stats or {}, pending, pages)
        return [[r] for r in decode_load_order(ordered, running, fits, self._max_running_gap)]


class DecodeRouter(_PolicyRouter):
    """Decode pool: fewest running requests (`lora_miss` more where the replica does not hold
    the request's adapter), then most free KV pages."""

    policy: DecodeLoadPolicy

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self, page_size: int = 16, lora_miss: float = 2.0
    ) -> None:
        self.policy = DecodeLoadPolicy(page_size, lora_miss=lora_miss)

    def rank(self, req: Any, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        cache = self.replica_queue_len_cache
        queue_lens = {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in candidates}
        stats = {k: r.routing_stats or {} for k, r in by_id.items()}
        ranked = self.policy.rank(list(by_id), kv_tokens(req), stats, queue_lens, lora_id(req))
        return [[by_id[k]] for k in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        if _request_of(pending_request) is not None:
            self.policy.routed(replica_id.unique_id, pending_request.metadata.internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.retain(rid.unique_id for rid in self._replicas)
