"""KV events: the radix cache's emission, the router's exact index fed by them, its decision
against a brute-force scorer, and the hub's log (no cluster)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.routing import PrefixAwarePolicy, PrefixIndex
from router.routing.disagg import DecodeCacheView, prefill_remotely
from workers.api import KVEventBatch, page_hashes
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import KVEventLog
from workers.kvcache.radix_cache import RadixCache
from workers.serve.kv_event_hub import LOG_BATCHES, KVEventHub

PS = 4


def cached(tokens: list[int], radix: RadixCache) -> None:
    pages = radix.allocator.allocate(len(tokens) // PS)
    assert pages is not None
    radix.allocator.free(radix.insert(tokens, pages).duplicate_pages)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 4)), max_size=30))
def test_the_cache_reports_every_page_it_stores_and_evicts_by_the_routers_names(
    ops: list[tuple[int, int, int]],
) -> None:
    radix = RadixCache(PS, PageAllocator(25))
    radix.events = KVEventLog()
    held: set[int] = set()  # what a reader of the events believes the cache holds
    prompts: list[list[int]] = []
    for base, pages, evict in ops:
        tokens = [base] * PS + [base * 10 + i for i in range((pages - 1) * PS)]
        radix.evict(max(0, pages - radix.allocator.num_free) + evict)
        if radix.allocator.num_free >= pages:
            cached(tokens, radix)
            prompts.append(tokens)
        stored, removed, _ = radix.events.drain()
        held = (held | set(stored)) - set(removed)
        assert held == set(radix.page_names())
    for tokens in prompts:  # the router's names of a prompt are the cache's
        names, k = page_hashes(tokens, PS), len(radix.match_prefix(tokens).pages)
        assert set(names[:k]) <= held and (k == len(names) or names[k] not in held)
    radix.check_invariants()


def test_a_net_batch_keeps_the_last_word_on_each_page() -> None:
    log = KVEventLog()
    log.stored([1, 2, 3])
    log.removed([2, 4])
    log.stored([4])
    log.offloaded([3, 5], 1)
    log.offloaded([5], 2)
    assert log.drain() == ([1, 4], [2], [(3, 1), (5, 2)])
    assert log.drain() == ([], [], [])


def test_index_follows_store_evict_and_drops_a_restarted_replica() -> None:
    index = PrefixIndex()
    names = page_hashes(list(range(40)), PS)  # 10 pages
    index.apply(KVEventBatch("r0", "a", stored=names))
    index.apply(KVEventBatch("r1", "x", stored=names[:4]))
    assert index.depth(names, "r0") == 10 and index.depth(names, "r1") == 4
    index.apply(KVEventBatch("r0", "a", removed=names[6:]))
    assert index.depth(names, "r0") == 6
    index.apply(KVEventBatch("r0", "b", stored=names[:2]))  # a new incarnation: empty cache
    assert index.depth(names, "r0") == 2 and index.num_pages("r0") == 2
    index.apply(KVEventBatch("r1", "x", stored=names[:1], snapshot=True))
    assert index.depth(names, "r1") == 1
    index.check_invariants()


def test_guesses_stand_until_confirmed_or_expired() -> None:
    now = [0.0]
    index = PrefixIndex(confirm_s=5.0, clock=lambda: now[0])
    a, b = page_hashes(list(range(16)), PS), page_hashes(list(range(100, 116)), PS)
    index.guess("r0", a)
    index.guess("r0", b)
    index.apply(KVEventBatch("r0", "i", stored=a))  # the replica cached a, never b
    now[0] = 6.0
    index.expire()
    assert index.depth(a, "r0") == 4 and index.depth(b, "r0") == 0
    index.check_invariants()


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3), st.integers(1, 8)), max_size=25),
    st.lists(st.integers(0, 400), min_size=12, max_size=12),
    st.integers(0, 3),
    st.integers(1, 9),
)
def test_the_decision_costs_what_a_brute_force_scorer_finds_best(
    n: int, caches: list[tuple[int, int, int]], loads: list[int], tenant: int, pages: int
) -> None:
    """The index walk visits only page holders and the least-loaded replica; its best must
    cost what scoring every replica finds."""
    replicas = [f"r{i}" for i in range(n)]
    policy = PrefixAwarePolicy(PS, load_weight=0.5)
    policy.retain(replicas)

    def prompt_of(t: int, k: int) -> list[int]:
        return [t] * PS + list(range(1000 * t, 1000 * t + (k - 1) * PS + 2))

    for r, t, k in caches:
        if r < n:
            policy.apply(KVEventBatch(replicas[r], "i", stored=page_hashes(prompt_of(t, k), PS)))
    for r, load in zip(replicas, loads, strict=False):
        policy.loads.set(r, load)
    prompt = prompt_of(tenant, pages)
    names = page_hashes(prompt, PS)

    def cost(r: str) -> float:
        uncached = policy.uncached_tokens(len(prompt), policy.index.depth(names, r))
        return uncached + 0.5 * policy.loads.get(r)

    best = policy.rank(prompt)[0]
    assert cost(str(best)) == min(cost(r) for r in replicas)


def test_hub_serves_batches_since_a_cursor_and_a_snapshot_otherwise() -> None:
    async def run() -> None:
        hub = KVEventHub()
        read = await hub.read("", 0)
        assert read.snapshot and read.batches == []
        await hub.publish("prefill", KVEventBatch("r0", "a", stored=[1, 2]))
        await hub.publish("prefill", KVEventBatch("r0", "a", removed=[1]))
        await hub.publish("decode", KVEventBatch("d0", "z", stored=[7]))
        again = await hub.read(read.epoch, read.cursor)
        assert not again.snapshot and [b.replica for _, b in again.batches] == ["r0", "r0", "d0"]
        assert (await hub.read(again.epoch, again.cursor)).batches == []
        snap = await hub.read("another epoch", again.cursor)  # the hub restarted, or a new reader
        assert snap.snapshot and {(p, b.replica, tuple(b.stored)) for p, b in snap.batches} == {
            ("prefill", "r0", (2,)),
            ("decode", "d0", (7,)),
        }
        for i in itertools.islice(itertools.count(), LOG_BATCHES + 1):
            await hub.publish("prefill", KVEventBatch("r0", "a", stored=[i]))
        assert (await hub.read(again.epoch, again.cursor)).snapshot  # fell behind the log

    asyncio.run(run())


def test_a_reader_with_nothing_new_waits_for_the_next_batch() -> None:
    """A long poll: answered as soon as a batch is logged (not at the end of the wait), and
    empty once the wait runs out; a heartbeat (an empty batch) answers nobody."""

    async def run() -> None:
        hub = KVEventHub()
        start = await hub.read("", 0)
        loop = asyncio.get_running_loop()
        waiting = asyncio.create_task(hub.read(start.epoch, start.cursor, wait_s=30))
        await asyncio.sleep(0.05)
        await hub.publish("decode", KVEventBatch("d0", "z"))  # a heartbeat
        await asyncio.sleep(0.05)
        assert not waiting.done()
        t0 = loop.time()
        await hub.publish("decode", KVEventBatch("d0", "z", stored=[7]))
        read = await asyncio.wait_for(waiting, 5)
        assert [b.stored for _, b in read.batches] == [[7]] and loop.time() - t0 < 1
        t0 = loop.time()
        assert (await hub.read(read.epoch, read.cursor, wait_s=0.2)).batches == []
        assert loop.time() - t0 >= 0.2

    asyncio.run(run())


def test_disaggregation_follows_what_the_decode_side_lacks_and_the_prefill_queue() -> None:
    from router.routing.kv_feed import close_feeds, feed_of

    view = DecodeCacheView("unit-test-app", PS, period_s=60.0)
    feed = feed_of("unit-test-app")
    assert feed is not None
    close_feeds()  # its thread would otherwise call Ray until the process exits
    assert feed_of("unit-test-app") is None and not feed._thread.is_alive()
    prompt = list(range(100))  # 25 pages
    assert view.uncached_tokens(prompt) == 100
    view._events.put(KVEventBatch("d0", "i", stored=page_hashes(prompt[:80], PS)))
    assert view.uncached_tokens(prompt) == 20
    assert not prefill_remotely(20, 0, max_local_tokens=32, max_waiting=0)  # decode prefills
    assert prefill_remotely(100, 3, max_local_tokens=32, max_waiting=4)
    assert not prefill_remotely(100, 4, max_local_tokens=32, max_waiting=4)  # pool backed up


def test_kv_event_metrics_per_role_and_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.backend import RoleStats
    from router.metrics import Metrics
    from router.routing import kv_feed
    from workers.engine_stats import EngineStats

    monkeypatch.setattr(
        kv_feed, "index_pages", lambda: {"prefill": [120, 30, 5], "decode": [7, 0, 0]}
    )
    metrics = Metrics("m")
    zero = {k: 0 for k, field in EngineStats.model_fields.items() if field.is_required()}
    prefill = EngineStats.model_validate(zero | {"kv_events_published": 42})
    metrics.engines.update([RoleStats("prefill", prefill)])
    text = metrics.render().decode()
    assert 'pdserve:kv_events_published_total{model_name="m",role="prefill"} 42.0' in text
    index = 'pdserve:router_index_pages{model_name="m",pool='
    assert index + '"prefill",tier="device"} 120.0' in text
    assert index + '"prefill",tier="host"} 30.0' in text
    assert index + '"prefill",tier="disk"} 5.0' in text
    assert index + '"decode",tier="device"} 7.0' in text


def test_a_publisher_batches_the_cache_changes_and_resends_all_on_a_new_hub() -> None:
    from workers.serve.kv_publisher import KVEventPublisher

    radix = RadixCache(PS, PageAllocator(16))
    publisher = KVEventPublisher("app", "prefill", "r0", radix, period_s=60.0)
    try:
        a, b = list(range(8)), list(range(100, 112))
        cached(a, radix)
        publisher.collect()
        cached(b, radix)
        radix.evict(1)  # the oldest leaf's last page: a's second
        publisher.collect()
        batch = publisher._next_batch()
        assert (batch.replica, batch.incarnation) == ("r0", publisher.incarnation)
        assert set(batch.stored) == set(page_hashes(a, PS)[:1] + page_hashes(b, PS))
        assert batch.removed == page_hashes(a, PS)[1:] and not batch.snapshot
        publisher._want_snapshot.set()  # as when the hub answers a new epoch
        publisher.collect()
        snapshot = publisher._next_batch()
        assert snapshot.snapshot and set(snapshot.stored) == set(radix.page_names())
    finally:
        publisher.close()


def test_evicted_pages_are_reported_in_the_tier_that_keeps_them() -> None:
    """A radix cache over tiers of 2 host pages (no disk): the pages it evicts are reported
    offloaded to host memory, and those the host tier then drops, removed; a reader of the
    events holds exactly the pages of the device and host tiers, with their tiers."""
    import torch

    from workers.kvcache.tiers.data import TierData
    from workers.kvcache.tiers.offloader import HOST, TieredStore

    pool = torch.arange(25 * 8, dtype=torch.float32).view(25, 8)  # 25 pages of 32 bytes
    tiers = TieredStore(TierData(pool, 2, None), PS, None)
    radix = RadixCache(PS, PageAllocator(25))
    radix.below, tiers.on_device = tiers, radix.holds
    radix.events = KVEventLog()
    held: dict[int, int] = {}
    for base in range(4):
        tokens = [base] * PS * 3
        cached(tokens, radix)
        radix.evict(2)  # two of this prompt's three pages go down
        stored, removed, offloaded = radix.events.drain()
        held |= dict.fromkeys(stored, 0) | dict(offloaded)
        held = {n: t for n, t in held.items() if n not in removed}
        device = {n: 0 for n in radix.page_names()}
        host = dict(tiers.names())
        assert held == device | host and set(host.values()) == {HOST} and len(host) == 2
        assert tiers.data.rows[tiers.host.entries[offloaded[0][0]].slot].tolist() != [0] * 32


def test_kv_tier_metrics_per_role_and_tier() -> None:
    from router.backend import RoleStats
    from router.metrics import Metrics
    from workers.engine_stats import EngineStats

    metrics = Metrics("m")
    zero = {k: 0 for k, field in EngineStats.model_fields.items() if field.is_required()}
    tiers = {"kv_host_pages": 12, "kv_disk_bytes": 4096, "kv_host_hit_tokens": 160,
             "kv_onload_bytes": 1 << 20, "kv_onloads": 3, "kv_onload_time_s": 0.25,
             "num_swap_preemptions": 2}  # fmt: skip
    metrics.engines.update([RoleStats("prefill", EngineStats.model_validate(zero | tiers))])
    text = metrics.render().decode()
    role = 'model_name="m",role="prefill"'
    assert f'pdserve:kv_tier_pages{{{role},tier="host"}} 12.0' in text
    assert f'pdserve:kv_tier_bytes{{{role},tier="disk"}} 4096.0' in text
    assert f'pdserve:kv_tier_hit_tokens_total{{{role},tier="host"}} 160.0' in text
    assert f"pdserve:kv_onload_bytes_total{{{role}}} 1.048576e+06" in text
    assert f"pdserve:kv_onload_time_seconds_count{{{role}}} 3.0" in text
    assert f"pdserve:num_swap_preemptions_total{{{role}}} 2.0" in text
