"""Replicas' stats on Ray's internal KV: every replica of a role is read back, live or not."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from router.metrics import Metrics, RequestStats
from router.metrics_board import MetricsBoard
from workers.engine_stats import EngineStats
from workers.serve import stats_board

pytestmark = pytest.mark.e2e


def stats(running: int) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=0,
        kv_pages_total=10,
        kv_pages_used=1,
        kv_pages_pinned=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens_computed=0,
        generation_tokens=0,
    )


def test_every_replica_of_a_role_is_read_and_stale_ones_are_not_live(ray_cluster) -> None:
    a = stats_board.StatsPoster("app", "decode", "r1")
    b = stats_board.StatsPoster("app", "decode", "r2")
    other = stats_board.StatsPoster("app", "prefill", "r3")
    a(stats(1)), b(stats(2)), other(stats(7))
    a(stats(5))  # within the post interval: not posted
    got = sorted((p.stats.num_running, p.live) for p in stats_board.read_pool("app", "decode"))
    assert got == [(1, True), (2, True)]
    assert [p.stats.num_running for p in stats_board.read_pool("app", "prefill")] == [7]
    assert stats_board.read_pool("other-app", "decode") == []
    later = time.time() + stats_board.STALE_AFTER_S + 1
    dead = stats_board.read_pool("app", "decode", now=later)  # kept for their counters
    assert sorted((p.stats.num_running, p.live) for p in dead) == [(1, False), (2, False)]
    for poster in (a, b, other):
        poster.close()


def test_router_replicas_render_each_others_request_metrics(ray_cluster) -> None:
    a, b = Metrics("m"), Metrics("m")
    a.success.labels("m", "stop").inc()
    a.observe("ttft", 0.2)
    b.success.labels("m", "stop").inc(2)
    board_a, board_b = MetricsBoard("router-app", "ra"), MetricsBoard("router-app", "rb")

    async def scenario() -> tuple[list[RequestStats], list[RequestStats]]:
        await board_a.post(a.request_stats())
        with contextlib.suppress(TimeoutError):  # the background loop: one post, then cancelled
            await asyncio.wait_for(board_b.run(b.request_stats), timeout=0.3)
        b.success.labels("m", "stop").inc()  # b's own live values win over its posted entry
        seen_by_a, peers_b = await board_a.peers(), await board_b.peers(b.request_stats())
        return seen_by_a, peers_b, await board_a.peers()

    peers_a, peers_b, later_a = asyncio.run(scenario())
    assert [p.success["stop"] for p in peers_a] == [2]
    assert [p.success["stop"] for p in peers_b] == [1]
    # b's scrape posted its live values: a later scrape on a renders at least as much.
    assert [p.success["stop"] for p in later_a] == [3]
    text = b.render(peers=peers_b).decode()
    assert 'pdserve:request_success_total{finished_reason="stop",model_name="m"} 4.0' in text
    assert 'pdserve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'pdserve:time_to_first_token_seconds_bucket{le="0.25",model_name="m"} 1.0' in text
