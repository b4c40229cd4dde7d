"""The routers prefer replicas that hold a request's LoRA adapter (their routing stats'
`lora_ids`), as a cost, not a rule: a holder's heavier load or another's cached prefix wins."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from router.routing import DecodeLoadPolicy, PrefixAwarePolicy
from tests.unit.test_prefix_router import (
    PS,
    REPLICAS,
    FakeID,
    FakeMetadata,
    FakePending,
    FakeReplica,
    policy_of,
    question,
    system_prompt,
)
from workers.api import LoRARequest, SamplingParams

LORA = LoRARequest(lora_name="a", lora_int_id=7, lora_path="/a")


@dataclass
class LoRAFakeRequest:
    prompt_token_ids: tuple[int, ...]
    params: Any = None
    lora: LoRARequest | None = None


def test_a_new_prompt_goes_to_a_replica_holding_its_adapter() -> None:
    policy = policy_of()
    for i in range(8):  # the ring would spread these over the pool
        assert policy.rank(question(i), lora_holders={"r2"})[0] == "r2"
    assert {policy.rank(question(i))[0] for i in range(8)} != {"r2"}


def test_a_busy_holder_or_a_cached_prefix_outweighs_the_adapter() -> None:
    policy = policy_of(lora_miss_tokens=64)
    policy.routed("r2", "long", system_prompt(9, pages=40))  # 160 tokens pending on r2
    assert policy.rank(question(0), lora_holders={"r2"})[0] != "r2"
    policy.completed("r2", "long")
    prompt = system_prompt(0) + question(1)  # 128 tokens of it cached on r1
    policy.routed("r1", "warm", system_prompt(0))
    policy.completed("r1", "warm")
    assert policy.rank(prompt, lora_holders={"r2"})[0] == "r1"
    assert PrefixAwarePolicy(PS, lora_miss_tokens=0).rank(prompt) == []  # an empty pool


def test_decode_prefers_a_holder_unless_it_runs_far_more() -> None:
    policy = DecodeLoadPolicy(PS, rng=random.Random(0), lora_miss=2)
    stats: dict[str, dict[str, Any]] = {r: {"num_running": 1, "kv_free_pages": 100}
                                        for r in REPLICAS}  # fmt: skip
    stats["r3"].update(lora_ids=[7], num_running=2)  # one more than the others
    assert policy.rank(REPLICAS, 16, stats, lora_int_id=7)[0] == "r3"
    assert policy.rank(REPLICAS, 16, stats)[-1] == "r3"  # the base model: by load alone
    stats["r3"]["num_running"] = 4  # more than a miss costs
    assert policy.rank(REPLICAS, 16, stats, lora_int_id=7)[0] != "r3"


def _router(kind: str) -> Any:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.routing import serve_routers

    cls = {"prefill": serve_routers.PrefillRouter, "decode": serve_routers.DecodeRouter}[kind]
    return cls(deployment_id=DeploymentID(name=kind, app_name="test"),
               handle_source=DeploymentHandleSource.UNKNOWN)  # fmt: skip


def test_serve_routers_read_the_held_adapters_from_the_routing_stats() -> None:
    async def run() -> None:
        for kind in ("prefill", "decode"):
            router = _router(kind)
            router.initialize_state(page_size=PS)
            stats = {"num_running": 0, "kv_free_pages": 64}
            replicas = [FakeReplica(FakeID(r), routing_stats=dict(stats)) for r in REPLICAS]
            replicas[1].routing_stats["lora_ids"] = [LORA.lora_int_id]  # type: ignore[assignment]
            router.update_replicas(replicas)
            params = SamplingParams(max_tokens=4)
            for i in range(6):
                req = LoRAFakeRequest(tuple(question(i)), params, LORA)
                pending = FakePending([req], FakeMetadata(f"{kind}-{i}"))
                first = (await router.choose_replicas(replicas, pending))[0][0]
                assert first is replicas[1], kind

    asyncio.run(run())
