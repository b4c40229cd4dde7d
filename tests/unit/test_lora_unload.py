"""An adapter unloaded at run time leaves the engines: once the app's registry no longer lists
it, a replica frees its device slot, host copy and cached pages, but only after the requests
already using it there have finished (they are not lost); adapters from the config stay."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lora_adapters import ALL_MODULES, make_lora_adapter
from workers import LoRARequest, SamplingParams
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import LORA_SALT, prefix_cache_ids
from workers.kvcache.radix_cache import RadixCache
from workers.protocol import GenerateRequest
from workers.serve.decode import DecodeWorker
from workers.serve.lora_sync import LoRASync, free_unloaded
from workers.serve.prefill import PrefillWorker

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(100, 120))


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[LoRARequest]:
    tmp = tmp_path_factory.mktemp("unload-loras")
    a = make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1)
    b = make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, ["q_proj", "v_proj"], seed=2)
    return [
        LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(a), runtime=True),
        LoRARequest(lora_name="b", lora_int_id=2, lora_path=str(b)),  # from the config
    ]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, page_size=2))


def _request(rid: str, lora: LoRARequest) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, params=GREEDY, lora=lora)


def _finish(engine: Engine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == rid and out.error is None
            tokens += out.token_ids
    return tokens


def _run(engine: Engine, rid: str, lora: LoRARequest) -> list[int]:
    engine.add_request(_request(rid, lora))
    return _finish(engine, rid)


def test_an_unloaded_adapter_is_freed_after_the_requests_using_it(engine, loras) -> None:
    a, b = loras
    want = _run(engine, "a0", a)
    _run(engine, "b0", b)
    stats = engine.stats()
    assert (stats.lora_resident, stats.lora_resident_ids) == (["a", "b"], [1, 2])
    assert free_unloaded(engine, {"a": a.lora_path}) == []  # still listed
    # a request resolved before the unload runs when the registry drops the adapter
    engine.add_request(_request("a1", a))
    first = [t for out in engine.step() for t in out.token_ids]
    assert free_unloaded(engine, {}) == []
    assert first + _finish(engine, "a1") == want  # it ran to its end with its adapter
    radix = engine.kv.radix
    cached = radix.num_cached_pages
    assert any(key[0] // LORA_SALT == a.lora_int_id for key in radix.root.children)
    assert free_unloaded(engine, {}) == ["a"]
    stats = engine.stats()
    assert (stats.lora_resident, stats.lora_resident_ids) == (["b"], [2])
    assert radix.num_cached_pages < cached
    assert all(key[0] // LORA_SALT != a.lora_int_id for key in radix.root.children)
    manager = engine.runner.lora
    assert a not in manager.resident and a.lora_int_id not in {*manager.host, *manager.taken}
    assert free_unloaded(engine, {}) == []  # b came from the config: an unload never frees it


def test_an_adapter_listed_under_another_path_is_freed(engine, loras) -> None:
    a = loras[0]
    _run(engine, "a2", a)
    assert free_unloaded(engine, {"a": "/elsewhere"}) == ["a"]
    assert "a" not in engine.stats().lora_resident


class _Tiers:
    """The KV tiers below the pool, as the radix cache offers them evicted pages."""

    def __init__(self) -> None:
        self.spilled: list[int] = []

    def spill(self, pages: list[int], *_: Any) -> list[bool]:
        self.spilled += pages
        return [False] * len(pages)


def test_an_unloaded_adapters_pages_are_freed_not_spilled_to_the_tiers() -> None:
    cache = RadixCache(2, PageAllocator(16))
    cache.below = tiers = _Tiers()  # type: ignore[assignment]
    for lora, tokens in ((1, [5, 6, 7, 8]), (2, [5, 6, 9, 9])):
        ids = prefix_cache_ids(tokens, lora)
        cache.insert(ids, cache.allocator.allocate(2))
    free = cache.allocator.num_free
    assert cache.drop_where(lambda key: key[0] // LORA_SALT == 1) == 2
    assert cache.allocator.num_free == free + 2 and tiers.spilled == []
    assert cache.evict(2) == 2 and len(tiers.spilled) == 2  # an LRU eviction still spills


class _FakeEngine:
    """What `LoRASync` reads of an engine: its LoRA manager's adapters, and the freeing."""

    def __init__(self, held: list[LoRARequest]) -> None:
        manager = type("Manager", (), {"taken": {r.lora_int_id: r for r in held}})()
        self.runner = type("Runner", (), {"lora": manager})()
        self.removed: list[int] = []

    def lora_ids_in_use(self) -> set[int]:
        return set()

    def remove_lora(self, lora_int_id: int) -> bool:
        self.removed.append(lora_int_id)
        return bool(self.runner.lora.taken.pop(lora_int_id))


def _poll(sync: LoRASync, engine: Any, bound_s: float = 10.0) -> list[str]:
    """What `sync` frees at the first step that frees something, stepping every 10 ms."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        freed = sync(engine)
        if freed:
            return freed
        time.sleep(0.01)
    raise AssertionError(f"nothing freed in {bound_s} s")


def test_sync_reads_the_registry_off_the_loop_while_it_holds_a_run_time_adapter(loras) -> None:
    reads: list[float] = []
    sync = LoRASync("app", 0.05, read=lambda app: reads.append(time.monotonic()) or {})
    static: Any = _FakeEngine([loras[1]])
    for _ in range(5):
        assert sync(static) == []
    time.sleep(0.2)
    assert reads == []  # no run-time adapter: nothing read
    engine: Any = _FakeEngine(loras)
    assert _poll(sync, engine) == ["a"] and engine.removed == [1]
    engine.runner.lora.taken[1] = loras[0]  # taken again by a late request
    assert _poll(sync, engine) == ["a"]
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert gaps and min(gaps) >= 0.05  # once a period


def test_a_read_that_began_before_an_adapter_was_held_does_not_free_it(loras) -> None:
    began, release = threading.Event(), threading.Event()

    def slow_read(app: str) -> dict[str, str]:  # a slow GCS: the loop must not wait for it
        began.set()
        release.wait(10)
        return {}

    sync = LoRASync("app", 0.05, read=slow_read)
    engine: Any = _FakeEngine([loras[0]])
    start = time.monotonic()
    assert sync(engine) == [] and began.wait(10)
    late = loras[0].model_copy(update={"lora_name": "c", "lora_int_id": 3})
    engine.runner.lora.taken[3] = late  # loaded, and registered, while the read ran
    assert sync(engine) == []
    assert time.monotonic() - start < 1.0  # the steps did not wait for the read
    release.set()
    assert _poll(sync, engine) == ["a"] and 3 in engine.runner.lora.taken  # c: not by that read
    assert _poll(sync, engine) == ["c"]  # a read that began after it was held: unlisted


@pytest.mark.parametrize("worker", [DecodeWorker, PrefillWorker])
def test_routing_stats_carry_the_adapters_a_replica_holds(engine, worker: type) -> None:
    replica = object.__new__(worker)
    stats = engine.stats().model_copy(update={"lora_resident": ["a"], "lora_resident_ids": [7]})
    replica.loop = type("Loop", (), {"stats": lambda self: stats})()
    assert replica.record_routing_stats()["lora_ids"] == [7]
