"""The prefix-aware router inside real Ray Serve, on KV events: three model-free prefill
replicas that cache each prompt in a real radix cache, publish its KV events and answer with
their own name; two routers (the handle of this test process and a forwarding deployment's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve

from router.routing.kv_feed import feed_of
from tests.e2e.conftest import running
from tests.waiting import wait_until
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import page_hashes
from workers.kvcache.radix_cache import RadixCache
from workers.protocol import GenerateRequest
from workers.serve.kv_event_hub import NAMESPACE, hub_name
from workers.serve.kv_publisher import KVEventPublisher

pytestmark = pytest.mark.e2e

PS = 16
APP = "prefix-routing"
EVENTS_PERIOD_S = 0.05


class NameReplica:
    """Stands in for a PrefillWorker: caches each prompt's pages in a radix cache, publishes
    its KV events as a PrefillWorker does, answers its actor name. A request whose id starts
    with "slow" holds the replica's slot for a second."""

    def __init__(self) -> None:
        ctx = serve.get_replica_context()
        self.radix = RadixCache(PS, PageAllocator(4096))
        self.events = KVEventPublisher(
            ctx.app_name, ctx.deployment, ctx.replica_id.unique_id, self.radix, EVENTS_PERIOD_S
        )

    async def prefill(self, req: GenerateRequest) -> str:
        tokens = req.prompt_token_ids
        pages = self.radix.allocator.allocate(len(tokens) // PS)
        assert pages is not None
        self.radix.allocator.free(self.radix.insert(tokens, pages).duplicate_pages)
        self.events.collect()
        if req.request_id.startswith("slow"):
            await asyncio.sleep(1.0)
        return str(ray.get_runtime_context().get_actor_name())

    def record_routing_stats(self) -> dict[str, float]:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}


class Forwarder:
    """A second router: its handle to the pool routes with its own `PrefillRouter`."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def prefill(self, req: GenerateRequest) -> str:
        return str(await self.pool.prefill.remote(req))

    def feed_reads(self) -> int:
        """Reads of the KV events its router's feed has had from the hub."""
        feed = feed_of(APP)
        return 0 if feed is None else feed.reads


@pytest.fixture(scope="module")
def routers(serve_url: str) -> Iterator[tuple[Any, Any]]:
    """(this process's handle to the pool, the forwarder's handle): two routers."""
    pool = serve.deployment(
        NameReplica,
        name="prefill",
        num_replicas=3,
        ray_actor_options={"num_cpus": 0},
        request_router_config={
            "request_router_class": "router.routing.serve_routers:PrefillRouter",
            "request_router_kwargs": {"page_size": PS, "kv_events_period_s": EVENTS_PERIOD_S},
            "request_routing_stats_period_s": 1.0,
        },
    ).bind()
    app = serve.deployment(Forwarder, ray_actor_options={"num_cpus": 0}).bind(pool)
    with running(APP, app, route_prefix=None) as forwarder:
        yield serve.get_deployment_handle("prefill", APP), forwarder
    ray.kill(ray.get_actor(hub_name(APP), namespace=NAMESPACE))


def request(rid: str, *parts: tuple[int, int]) -> GenerateRequest:
    """A prompt of `parts`: (first token, pages) each, PS tokens a page, plus a short tail."""
    tokens = [t for first, pages in parts for t in range(first, first + pages * PS)]
    return GenerateRequest(request_id=rid, prompt_token_ids=(*tokens, 7, 7, 7))


def send(router: Any, req: GenerateRequest) -> str:
    return str(router.prefill.remote(req).result(timeout_s=30))


def hub_holds(req: GenerateRequest) -> bool:
    """Whether some replica's published cache holds all of `req`'s whole pages."""
    read = ray.get(ray.get_actor(hub_name(APP), namespace=NAMESPACE).read.remote("", 0))
    last = page_hashes(req.prompt_token_ids, PS)[-1]
    return any(last in batch.stored for _, batch in read.batches)


def running_replicas() -> int:
    states = serve.status().applications[APP].deployments["prefill"].replica_states
    return int(states.get("RUNNING", 0))


def kill(replica: str) -> None:
    """Kill the replica actor `replica` and wait until a call to it fails: `ray.kill` only asks
    for the kill, and the replica answers what reaches it before it dies."""
    actor = ray.get_actor(replica, namespace="serve")
    ray.kill(actor, no_restart=True)

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=30)
        except ray.exceptions.ActorDiedError:
            return True
        except ray.exceptions.ActorUnavailableError:  # gone, but Ray has yet to tell it died
            pass
        return False

    wait_until(dead, 30, what=f"{replica} to die")


def catch_up(forwarder: Any) -> None:
    """Wait until the forwarder's router has read the hub twice more (all published so far)."""
    start = forwarder.feed_reads.remote().result(timeout_s=30)
    wait_until(lambda: forwarder.feed_reads.remote().result(timeout_s=30) >= start + 2, 10,
               interval_s=0.05, what="the forwarder's router to read the KV events")  # fmt: skip


def test_prompts_sharing_a_prefix_stay_on_one_replica_through_a_replica_death(
    routers: tuple[Any, Any],
) -> None:
    pool, _ = routers

    def homes(tenant: int, n: int) -> set[str]:
        """Where `n` prompts of `tenant` go, one after another; the pause lets the router hear
        of each completion (a caller can see its result before `on_request_completed()`)."""
        names = set()
        for i in range(n):
            names.add(send(pool, request(f"{tenant}-{i}", (10_000 * (tenant + 1), 8), (i, 1))))
            time.sleep(0.2)
        return names

    by_tenant = [homes(tenant, 2) for tenant in range(8)]
    assert all(len(h) == 1 for h in by_tenant), by_tenant
    assert len(set().union(*by_tenant)) > 1  # different prefixes do not all pile onto one replica

    dead = next(iter(by_tenant[0]))
    kill(dead)
    after = homes(0, 1)  # Serve retries on a live replica: the caller sees no error
    assert dead not in after
    assert len(homes(0, 3) | after) == 1  # sticky again, on its new home


def test_a_router_routes_on_what_another_router_sent_and_never_on_a_dead_cache(
    routers: tuple[Any, Any],
) -> None:
    pool, forwarder = routers
    wait_until(lambda: running_replicas() == 3, 60, interval_s=0.2,
               what="the replica killed by the test before to be replaced")  # fmt: skip
    send(forwarder, request("warm-up", (600_000, 1)))  # its router starts reading the events
    shared = (900_000, 1)
    # The pool's router sends a long prompt that shares the first page of the prefix S below:
    # it lands on S's pick for an idle pool (the hash ring of that first page), X, and holds it.
    slow_req = request("slow", shared, (800_000, 40))
    slow = pool.prefill.remote(slow_req)
    wait_until(lambda: hub_holds(slow_req), 10, interval_s=0.05, what="X to cache the slow one")
    s = (shared, (700_000, 12))  # S: 13 pages
    home = send(pool, request("s-0", *s, (1, 1)))  # X is busy: S goes elsewhere
    x = slow.result(timeout_s=30)
    assert home != x

    # The forwarder never sent S, and its idle-pool pick would be X: the KV events say where
    # S is cached.
    wait_until(lambda: hub_holds(request("s-0", *s, (1, 1))), 10, interval_s=0.05,
               what="S's home to publish it")  # fmt: skip
    catch_up(forwarder)
    assert send(forwarder, request("s-1", *s, (2, 1))) == home

    # Kill S's home: Serve replaces it with an empty replica. Neither router routes on the
    # dead cache: S goes where the live caches say, to X, which holds its first page.
    kill(home)
    after = {send(r, request(f"s-after-{i}", *s, (3, 1))) for i, r in enumerate(routers)}
    assert after == {x}
