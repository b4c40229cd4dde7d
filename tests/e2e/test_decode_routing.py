"""Prefix-aware decode routing in real Ray Serve (`router.decode_prefix_aware`): a
conversation's next turn goes to the decode replica that holds its earlier turn (known from the
replicas' KV events), which then reads only the new pages over NIXL. Two decode replicas; the
load-aware router alone would send the second turn to the other one (it has more free pages)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import deployed
from tests.e2e.serve_metrics import settled_counters

pytestmark = pytest.mark.e2e

PAGE = 4
TURN_1 = [1] + [300 + 7 * i for i in range(6 * PAGE - 1)]  # 6 whole pages
COUNTERS = [("decode", "kv_pages_read"), ("decode", "kv_pages_reused"),
            ("decode", "kv_events_published")]  # fmt: skip


@pytest.fixture(scope="module")
def base_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    rank = {"num_cpus_per_rank": 0.5}
    router = {"num_cpus": 0, "decode_prefix_aware": True, "routing_stats_period_s": 0.5}
    args = {
        "engine": {"model": tiny_llama, "num_kv_pages": 64, "page_size": PAGE},
        "served_model_name": "tiny",
        "prefill": rank,
        "decode": {"num_replicas": 2, **rank},
        "router": router,
    }
    with deployed(serve_url, "decode-routing", args) as base:
        yield base


def complete(base_url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def test_the_next_turn_reads_only_its_new_pages(base_url: str) -> None:
    complete(base_url, TURN_1)
    before = settled_counters(base_url, COUNTERS)
    assert before["decode kv_pages_read"] == 6  # the first turn's prompt, all of it
    complete(base_url, TURN_1 + [500 + i for i in range(2 * PAGE)])  # two pages more
    after = settled_counters(base_url, COUNTERS)
    assert after["decode kv_pages_reused"] - before["decode kv_pages_reused"] == 6
    assert after["decode kv_pages_read"] - before["decode kv_pages_read"] == 2
    assert after["decode kv_events_published"] > 0  # the router knew the pages from the events
