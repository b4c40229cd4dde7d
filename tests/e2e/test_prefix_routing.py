"""The prefix-aware router inside real Ray Serve: three model-free replicas that answer with
their own name, called through a DeploymentHandle the way the ingress calls the prefill pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve

from tests.e2e.conftest import running
from workers.protocol import GenerateRequest

pytestmark = pytest.mark.e2e

PS = 16


class NameReplica:
    """Stands in for a PrefillWorker: `prefill(req)` answers this replica's actor name."""

    async def prefill(self, req: GenerateRequest) -> str:
        return ray.get_runtime_context().get_actor_name()

    def record_routing_stats(self) -> dict[str, float]:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}


@pytest.fixture(scope="module")
def pool(serve_url: str) -> Iterator[Any]:
    app = serve.deployment(
        NameReplica,
        name="prefill",
        num_replicas=3,
        ray_actor_options={"num_cpus": 0},
        request_router_config={
            "request_router_class": "router.routing.serve_routers:PrefillRouter",
            "request_router_kwargs": {"page_size": PS},
            "request_routing_stats_period_s": 1.0,
        },
    ).bind()
    with running("prefix-routing", app, route_prefix=None) as handle:
        yield handle


def prompt(tenant: int, i: int) -> GenerateRequest:
    system = [1000 * (tenant + 1) + j for j in range(8 * PS)]
    return GenerateRequest(
        request_id=f"{tenant}-{i}", prompt_token_ids=(*system, *range(100 + i, 110 + i))
    )


def replicas_of(pool: Any, tenant: int, n: int) -> set[str]:
    """Where `n` prompts of `tenant` go, one after another. The pause lets the router hear of
    each completion: a caller can see its result before `on_request_completed()` runs, and
    until then the router counts the prompt as pending work on its replica."""
    names = set()
    for i in range(n):
        names.add(pool.prefill.remote(prompt(tenant, i)).result(timeout_s=30))
        time.sleep(0.2)
    return names


def test_prompts_sharing_a_prefix_stay_on_one_replica_through_a_replica_death(pool: Any) -> None:
    homes = [replicas_of(pool, tenant, 4) for tenant in range(6)]
    assert all(len(h) == 1 for h in homes), homes
    assert len(set().union(*homes)) > 1  # different prefixes do not all pile onto one replica

    dead = next(iter(homes[0]))
    ray.kill(ray.get_actor(dead, namespace="serve"), no_restart=True)
    after = replicas_of(pool, 0, 1)  # Serve retries on a live replica: the caller sees no error
    assert dead not in after
    assert len(replicas_of(pool, 0, 4) | after) == 1  # sticky again, on its new home
