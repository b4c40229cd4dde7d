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

from router.routing.policy import DecodeLoadPolicy, PrefixAwarePolicy

logger = logging.getLogger(__name__)


def _request_of(pending: PendingRequest | None) -> Any | None:
    """The `GenerateRequest` a `prefill(req)` / `generate(req, first)` call carries, else None."""
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    return req if hasattr(req, "prompt_token_ids") else None


class _PolicyRouter(RequestRouter):
    """What both routers share: a policy that tracks in-flight requests and live replicas."""

    policy: PrefixAwarePolicy | DecodeLoadPolicy

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when all are full
        req = _request_of(pending_request)
        if req is None:
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        queue_lens = {rid: cache.get(rid) or 0 for rid in by_id}
        return [[by_id[rid]] for rid in self.rank(req, by_id, queue_lens)]

    def rank(
        self, req: Any, replicas: dict[ReplicaID, RunningReplica], queue_lens: dict[ReplicaID, int]
    ) -> list[ReplicaID]:
        """`replicas`' ids, best first, for the request `req`."""
        raise NotImplementedError

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.retain(r.replica_id for r in replicas)


class PrefillRouter(_PolicyRouter):
    """Prefill pool: longest cached prefix weighed against pending prefill work."""

    policy: PrefixAwarePolicy

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self,
        page_size: int = 16,
        load_weight: float = 1.0,
        imbalance_threshold: int = 8,
        pages_per_replica: int = 1 << 16,
    ) -> None:
        self.policy = PrefixAwarePolicy(
            page_size,
            load_weight=load_weight,
            imbalance_threshold=imbalance_threshold,
            pages_per_replica=pages_per_replica,
        )

    def rank(
        self, req: Any, replicas: dict[ReplicaID, RunningReplica], queue_lens: dict[ReplicaID, int]
    ) -> list[ReplicaID]:
        return self.policy.rank(list(replicas), req.prompt_token_ids, queue_lens)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        req = _request_of(pending_request)
        if req is not None:
            request = pending_request.metadata.internal_request_id
            self.policy.routed(replica_id, request, req.prompt_token_ids)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
        logger.info("prefix router: forgot dead replica %s", replica_id)


class DecodeRouter(_PolicyRouter):
    """Decode pool: fewest running requests, then most free KV pages."""

    policy: DecodeLoadPolicy

    def initialize_state(self, page_size: int = 16) -> None:  # type: ignore[override]
        self.policy = DecodeLoadPolicy(page_size)

    def rank(
        self, req: Any, replicas: dict[ReplicaID, RunningReplica], queue_lens: dict[ReplicaID, int]
    ) -> list[ReplicaID]:
        stats = {rid: r.routing_stats or {} for rid, r in replicas.items()}
        num_tokens = len(req.prompt_token_ids) + req.params.max_tokens
        return self.policy.rank(list(replicas), num_tokens, stats, queue_lens)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        if _request_of(pending_request) is not None:
            self.policy.routed(replica_id, pending_request.metadata.internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.retain(self._replicas)
