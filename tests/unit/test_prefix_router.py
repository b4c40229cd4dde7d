"""The routing policies in plain Python: prefix affinity, load against affinity, replicas that
come and go, the index's bound; then the Serve routers' hooks on fake replicas (no cluster)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from router.routing import DecodeLoadPolicy, PrefixAwarePolicy, PrefixIndex
from router.routing.policy import InFlight
from workers.api import page_hashes

PS = 4
REPLICAS = ["r0", "r1", "r2", "r3"]


def policy_of(**kw: Any) -> PrefixAwarePolicy:
    """An approximate policy (index guessed from what it sent) over REPLICAS."""
    policy = PrefixAwarePolicy(PS, pages_per_replica=kw.pop("pages_per_replica", 1 << 16), **kw)
    policy.retain(REPLICAS)
    return policy


def system_prompt(tenant: int, pages: int = 32) -> list[int]:
    return [1000 * (tenant + 1) + i for i in range(pages * PS)]


def question(i: int, n: int = 10) -> list[int]:
    return [50_000 + 100 * i + j for j in range(n)]


def route(policy: PrefixAwarePolicy, prompt: list[int], request: str) -> str:
    """Rank, send to the best, and let it finish at once (an idle pool)."""
    best = policy.rank(prompt)[0]
    policy.routed(best, request, prompt)
    policy.completed(best, request)
    return str(best)


def test_page_hashes_name_a_page_by_everything_before_it() -> None:
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], PS)
    b = page_hashes([0, 0, 0, 0, 5, 6, 7, 8], PS)
    assert len(a) == 2  # the partial third page is not named
    assert a[1] != b[1]  # same tokens, different prefix
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PS) == a
    assert page_hashes([5, 6, 7, 8], PS, parent=a[0]) == a[1:]  # chained from a parent's name


def test_same_prefix_prompts_go_to_the_same_replica() -> None:
    policy = policy_of()
    chosen = {
        tenant: {route(policy, system_prompt(tenant) + question(i), f"{tenant}-{i}")
                 for i in range(10)}
        for tenant in range(4)
    }  # fmt: skip
    assert all(len(replicas) == 1 for replicas in chosen.values())


def test_new_prefixes_spread_over_idle_replicas() -> None:
    policy = policy_of()
    firsts = {route(policy, system_prompt(t), f"t{t}") for t in range(40)}
    assert len(firsts) == len(REPLICAS)


def test_two_routers_send_a_new_prefix_to_the_same_replica() -> None:
    prompt = system_prompt(7) + question(0)
    other = PrefixAwarePolicy(PS)
    other.retain(reversed(REPLICAS))
    assert policy_of().rank(prompt)[0] == other.rank(prompt)[0]


def test_longest_cached_prefix_wins() -> None:
    policy = policy_of()
    base = system_prompt(0)
    policy.routed("r1", "short", base[: 8 * PS])
    policy.routed("r2", "long", base[: 24 * PS])
    policy.completed("r1", "short")
    policy.completed("r2", "long")
    assert policy.rank(base + question(1))[0] == "r2"


def test_pending_prefill_work_outweighs_a_short_cached_prefix() -> None:
    policy = policy_of()
    prompt = system_prompt(0, pages=4) + question(0, n=400)  # 16 cached tokens of 416
    policy.routed("r1", "warm", prompt[: 4 * PS])
    policy.completed("r1", "warm")
    assert policy.rank(prompt)[0] == "r1"
    policy.routed("r1", "busy", question(9, n=200))  # 200 tokens still to prefill on r1
    assert policy.rank(prompt)[0] != "r1"
    policy.completed("r1", "busy")
    assert policy.rank(prompt)[0] == "r1"


def test_requests_in_flight_count_as_load_until_they_complete() -> None:
    policy = policy_of()
    prompt = system_prompt(0) + question(0)
    home = route(policy, prompt, "warm")
    for i in range(3):
        policy.routed(home, f"q{i}", system_prompt(i + 1))  # 3 x 128 new tokens on `home`
    policy.routed(home, "q0", system_prompt(1))  # a retry of q0 is counted once
    assert policy.in_flight.count(home) == 3
    assert policy.rank(prompt)[0] != home
    policy.completed(home, "q0")
    policy.completed(home, "q1")
    policy.completed(home, "never-routed")  # a rejected request completes without being routed
    assert policy.rank(prompt)[0] == home


def test_a_completion_reported_before_its_routing_leaves_no_pending_work() -> None:
    policy = policy_of()
    prompt = system_prompt(0) + question(0)
    home = route(policy, prompt, "warm")
    policy.completed(home, "fast")  # Serve's two events for one fast request, out of order
    policy.routed(home, "fast", prompt)
    assert policy.in_flight.count(home) == 0 and policy.in_flight.work(home) == 0
    assert policy.rank(prompt + question(1))[0] == home


def test_a_retry_counts_where_it_went_whatever_order_its_attempts_come_back_in() -> None:
    policy = policy_of()
    prompt = system_prompt(0) + question(0)
    policy.routed("r0", "q", prompt)  # accepted, then r0 died
    policy.routed("r1", "q", prompt)  # Serve's retry
    policy.completed("r0", "q")  # the dead attempt comes back after the retry was routed
    assert policy.in_flight.count("r1") == 1 and policy.in_flight.count("r0") == 0
    policy.completed("r1", "q")
    assert policy.in_flight.replicas == set()


def test_early_completions_are_bounded() -> None:
    in_flight = InFlight(early_limit=8)
    for i in range(100):
        in_flight.remove("r0", f"rejected-{i}")  # rejected: never routed
    in_flight.add("r0", "rejected-0", 1)  # long forgotten: counted
    in_flight.add("r0", "rejected-99", 1)  # remembered: it already came back
    assert in_flight.count("r0") == 1


def test_a_dead_replica_is_forgotten() -> None:
    policy = policy_of()
    prompt = system_prompt(0) + question(0)
    home = route(policy, prompt, "warm")
    policy.routed(home, "running", prompt)
    policy.forget(home)
    assert policy.index.num_pages(home) == 0 and policy.in_flight.count(home) == 0
    policy.index.check_invariants()
    policy.retain(alive := [r for r in REPLICAS if r != home])
    assert policy.rank(prompt)[0] in alive
    policy.completed(home, "running")  # its answer may still come back: harmless


def test_replicas_that_left_the_pool_are_forgotten_and_new_ones_rank_as_uncached() -> None:
    policy = policy_of()
    prompt = system_prompt(0) + question(0)
    home = route(policy, prompt, "warm")
    policy.retain(["new0", "new1"])
    assert policy.index.replicas == set() and policy.in_flight.replicas == set()
    assert policy.rank(prompt)[0] in {"new0", "new1"}
    assert policy.index.depth(page_hashes(prompt, PS), home) == 0


def test_index_is_bounded_per_replica() -> None:
    policy = policy_of(pages_per_replica=100)
    for t in range(50):
        route(policy, system_prompt(t) + question(t), f"t{t}")
    assert all(policy.index.num_pages(r) <= 100 for r in REPLICAS)
    assert policy.index.num_entries <= 100 * len(REPLICAS)
    policy.index.check_invariants()


def test_eviction_takes_the_deepest_pages_of_the_oldest_prompt_first() -> None:
    index = PrefixIndex(pages_per_replica=40)
    old, new = page_hashes(system_prompt(0), PS), page_hashes(system_prompt(1, pages=16), PS)
    index.guess("r0", old)  # 32 pages
    index.guess("r0", new)  # 16 more: 8 of the old prompt's pages must go
    assert index.depth(old, "r0") == 24
    assert index.depth(new, "r0") == 16
    index.check_invariants()


def test_decode_prefers_fewest_running_then_most_free_pages() -> None:
    policy = DecodeLoadPolicy(PS, rng=random.Random(0))
    stats = {
        "r0": {"num_running": 3, "kv_free_pages": 900},
        "r1": {"num_running": 1, "kv_free_pages": 100},
        "r2": {"num_running": 1, "kv_free_pages": 500},
        "r3": {"num_running": 0, "kv_free_pages": 10},  # idle but cannot hold 200 tokens
    }
    assert policy.rank(REPLICAS, 200, stats) == ["r2", "r1", "r0", "r3"]
    policy.routed("r2", "a")
    policy.routed("r2", "b")  # our own sends count before the stats catch up
    assert policy.rank(REPLICAS, 200, stats)[0] == "r1"
    policy.completed("r2", "a")
    policy.completed("r2", "b")
    assert policy.rank(REPLICAS, 200, stats, queue_lens={"r2": 5})[0] == "r1"


# ---- the Serve routers' hooks, on fake replicas ----


@dataclass(frozen=True)
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakeRequest:
    prompt_token_ids: tuple[int, ...]
    params: Any = None


@dataclass
class FakePending:
    args: list[Any]
    metadata: FakeMetadata
    routing_context: Any = field(default_factory=lambda: type("Ctx", (), {})())


@dataclass(frozen=True)
class FakeID:
    unique_id: str


@dataclass(eq=False)
class FakeReplica:
    replica_id: FakeID
    max_ongoing_requests: int = 8
    routing_stats: dict[str, float] = field(default_factory=dict)


def test_serve_prefill_router_learns_from_routed_requests_and_forgets_dead_replicas() -> None:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.routing.serve_routers import PrefillRouter

    async def run() -> None:
        router = PrefillRouter(
            deployment_id=DeploymentID(name="prefill", app_name="test"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(page_size=PS)
        replicas = [FakeReplica(FakeID(r)) for r in REPLICAS]
        router.update_replicas(replicas)  # type: ignore[arg-type]
        prompt = tuple(system_prompt(0) + question(0))

        def pending(rid: str) -> FakePending:
            return FakePending([FakeRequest(prompt)], FakeMetadata(rid))

        ranks = await router.choose_replicas(replicas, pending("a"))
        assert len(ranks[0]) == 1  # the best alone, then the others
        assert sorted(r.replica_id.unique_id for rank in ranks for r in rank) == REPLICAS
        home = ranks[1][0].replica_id  # send it to the second choice, as after a rejection
        router.on_request_routed(pending("a"), home, None)  # type: ignore[arg-type]
        router.on_request_completed(home, "a")  # type: ignore[arg-type]
        assert (await router.choose_replicas(replicas, pending("b")))[0][0].replica_id == home
        assert await router.choose_replicas(replicas, FakePending([], FakeMetadata("s"))) == [
            replicas
        ]  # a stats call: one rank, Serve picks by queue length
        router.on_replica_actor_died(home)  # type: ignore[arg-type]
        assert router.policy.index.num_pages(home.unique_id) == 0

    asyncio.run(run())


def test_decode_load_order_keeps_the_prefix_order_unless_a_replica_is_full_or_far_busier() -> None:
    from router.routing.policy import decode_load_order

    ranked = ["a", "b", "c"]  # by the pages each holds
    idle = {"a": 0, "b": 0, "c": 0}
    assert decode_load_order(ranked, idle, {}, max_running_gap=8) == ranked
    assert decode_load_order(ranked, idle, {"a": False}, max_running_gap=8) == ["b", "c", "a"]
    busy = {"a": 12, "b": 3, "c": 9}  # a runs more than 8 above the least busy; c does not
    assert decode_load_order(ranked, busy, {}, max_running_gap=8) == ["b", "c", "a"]
    assert decode_load_order(ranked, busy, {"b": False}, max_running_gap=8) == ["c", "a", "b"]


def test_decode_prefix_router_puts_a_full_replica_last() -> None:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.routing.serve_routers import DecodePrefixRouter
    from workers.api import SamplingParams

    async def run() -> None:
        router = DecodePrefixRouter(
            deployment_id=DeploymentID(name="decode", app_name="test"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(page_size=PS, max_running_gap=8)
        replicas = [FakeReplica(FakeID(r), routing_stats={"num_running": 0, "kv_free_pages": 64})
                    for r in REPLICAS]  # fmt: skip
        router.update_replicas(replicas)  # type: ignore[arg-type]
        prompt = tuple(system_prompt(0) + question(0))
        params = SamplingParams(max_tokens=16)
        pending = FakePending([FakeRequest(prompt, params)], FakeMetadata("a"))
        first = (await router.choose_replicas(replicas, pending))[0][0]
        first.routing_stats["kv_free_pages"] = 0  # cannot hold the request any more
        ranks = await router.choose_replicas(replicas, pending)
        assert all(len(rank) == 1 for rank in ranks) and ranks[-1][0] is first

    asyncio.run(run())


def test_a_replica_whose_engine_died_is_skipped_at_once() -> None:
    """A call's `EngineDeadError` names its replica: the routers of this process skip it from
    the next decision on; with every replica dead a decode call waits (no rank), a prefill call
    goes to a dead one (it fails at once: the decode replica prefills instead)."""
    from ray.exceptions import RayTaskError
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.routing.dead_replicas import DeadReplicas
    from router.routing.serve_routers import DecodeRouter, PrefillRouter
    from workers.api import EngineDeadError, SamplingParams

    def died(replica: str) -> RayTaskError:
        error = EngineDeadError("the engine died: RuntimeError: CUDA error")
        error.replica = replica
        return RayTaskError("generate", "traceback", error).as_instanceof_cause()

    async def run() -> None:
        routers = {
            pool: cls(deployment_id=DeploymentID(name=pool, app_name="deaths"),
                      handle_source=DeploymentHandleSource.UNKNOWN)
            for pool, cls in (("decode", DecodeRouter), ("prefill", PrefillRouter))
        }  # fmt: skip
        routers["decode"].initialize_state(page_size=PS)
        routers["prefill"].initialize_state(page_size=PS)
        replicas = [FakeReplica(FakeID(r)) for r in REPLICAS[:2]]
        req = FakeRequest(tuple(question(0)), SamplingParams(max_tokens=4))
        for pool, router in routers.items():
            router.update_replicas(replicas)  # type: ignore[arg-type]
            pending = FakePending([req], FakeMetadata(pool))
            ranked = await router.choose_replicas(replicas, pending)
            assert sorted(r.replica_id.unique_id for rank in ranked for r in rank) == ["r0", "r1"]
            DeadReplicas.of("deaths", pool).mark(died("r0"))
            ranked = await router.choose_replicas(replicas, pending)
            assert [r.replica_id.unique_id for rank in ranked for r in rank] == ["r1"]
            DeadReplicas.of("deaths", pool).mark(died("r1"))
            ranked = await router.choose_replicas(replicas, pending)
            chosen = sorted(r.replica_id.unique_id for rank in ranked for r in rank)
            assert chosen == ([] if pool == "decode" else ["r0", "r1"])
            assert pending.routing_context.should_backoff  # Serve backs off, not spins

    asyncio.run(run())
