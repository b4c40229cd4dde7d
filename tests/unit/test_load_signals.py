"""Load signals count the KV pages requests hold (`EngineStats.kv_pages_held`): the prefix
cache's evictable pages are free to allocate, so a replica whose cache is warm and that runs
nothing looks as empty as a cold one to the routers and to the SLA autoscaler."""

from __future__ import annotations

import asyncio

import pytest

from cluster.autoscaling_policy import Targets, load_ratios, pool_signals
from router.routing.policy import DecodeLoadPolicy
from tests.waiting import wait_until
from workers import SamplingParams
from workers.engine_stats import EngineStats
from workers.protocol import GenerateRequest
from workers.serve.decode import DecodeWorker
from workers.serve.load_meter import KV_USAGE
from workers.serve.prefill import PrefillWorker
from workers.serve.worker import EngineWorker

PAGE = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[100 + 7 * i + j for j in range(3 * PAGE)] for i in range(3)]  # 3 full pages each
DECODE = Targets(tpot_ms=20, usage_target=1)


def test_held_pages_are_the_used_ones_less_the_evictable() -> None:
    s = EngineStats(
        num_running=1, num_waiting=0, kv_pages_total=32, kv_pages_used=12, kv_pages_pinned=0,
        kv_pages_cached=9, kv_pages_evictable=7, prefix_cache_queries=0, prefix_cache_hits=0,
        num_preemptions=0, prompt_tokens_computed=0, generation_tokens=0,
    )  # fmt: skip
    assert s.kv_pages_held == 5  # 2 cached pages a running request shares still count


async def serve(worker: EngineWorker) -> None:
    for i, prompt in enumerate(PROMPTS):
        req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=PARAMS)
        async for _ in worker.generate(req):
            pass


@pytest.mark.parametrize("worker_class", [PrefillWorker, DecodeWorker])
def test_a_warm_prefix_cache_with_nothing_running_looks_empty(
    tiny_llama: str, worker_class: type[EngineWorker]
) -> None:
    worker = worker_class({"model": tiny_llama, "num_kv_pages": 32, "page_size": PAGE}, {})
    try:
        asyncio.run(serve(worker))
        s = wait_until(
            lambda: (s := worker.loop.stats()).num_running == 0 and s.kv_pages_cached >= 9 and s,
            30,
            what="the requests to finish and leave their pages in the prefix cache",
        )
        assert s.kv_pages_used >= 9 and s.kv_pages_evictable == s.kv_pages_used
        assert s.kv_pages_held == 0
        routing = worker.record_routing_stats()
        if worker_class is DecodeWorker:
            assert routing["kv_free_pages"] == s.kv_pages_total
            # ahead of an idle replica one of whose pages a request holds
            busier = {"num_running": 0, "kv_free_pages": s.kv_pages_total - 1}
            stats = {"warm": routing, "busier": busier}
            assert DecodeLoadPolicy(PAGE).rank(["busier", "warm"], PAGE, stats)[0] == "warm"
        else:
            assert routing["kv_usage"] == 0
        signals = worker.record_autoscaling_stats()
        assert signals[KV_USAGE] == 0
        pool = pool_signals({name: {"r1": value} for name, value in signals.items()})
        assert load_ratios(pool, DECODE, running=1)["kv"] == 0
    finally:
        worker.loop.shutdown()
        worker.engine.agent.close()
