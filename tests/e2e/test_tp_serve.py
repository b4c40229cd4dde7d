"""Tensor parallelism and decode routing in real Ray Serve, on one application `build_app` makes
of a config with a TP-1 prefill pool and two TP-2 decode replicas, called over HTTP and through
a handle:
- each decode replica is rank 0 in bundle 0 of its own placement group, its rank actor takes
  bundle 1, and it serves the single-process engine's tokens;
- each decode rank reads its KV head from the one prefill rank (staged); prompts of at most 4
  tokens skip the prefill pool (`router.decode_prefill_max_tokens`): the TP-2 decode group
  prefills them itself;
- prefix-aware decode routing (`router.decode_prefix_aware`): a conversation's next turn goes to
  the decode replica that holds its earlier turn (known from the replicas' KV events), which then
  reads only the new pages over NIXL (the load-aware router alone would send it to the other one:
  it has more free pages).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.e2e.conftest import deployed
from tests.e2e.serve_metrics import pool_counter, pool_gauge, settled_counters
from tests.waiting import wait_until
from workers import LLM, SamplingParams
from workers.protocol import GenerateRequest

pytestmark = pytest.mark.e2e

PAGE = 4
ENGINE = {"num_kv_pages": 64, "page_size": PAGE}
PROMPT = [1, 450, 7483, 310, 3444, 338, 3681, 29892, 1]
TURN_1 = [1] + [300 + 7 * i for i in range(6 * PAGE - 1)]  # 6 whole pages
COUNTERS = [("decode", "prompt_tokens"), ("prefill", "prompt_tokens"), ("decode", "kv_pages_read"),
            ("decode", "kv_pages_reused"), ("decode", "kv_events_published")]  # fmt: skip


@pytest.fixture(scope="module")
def other_groups(serve_url: str) -> set[str]:
    """The placement groups of the applications other modules left running."""
    return set(ray.util.placement_group_table())


@pytest.fixture(scope="module")
def base_url(serve_url: str, tiny_llama: str, other_groups: set[str]) -> Iterator[str]:
    rank = {"num_cpus_per_rank": 0.5}
    router = {"num_cpus": 0, "decode_prefill_max_tokens": 4, "decode_prefix_aware": True,
              "routing_stats_period_s": 0.5}  # fmt: skip
    args = {
        "engine": {"model": tiny_llama, **ENGINE},
        "served_model_name": "tiny",
        "prefill": {"tensor_parallel_size": 1, **rank},
        "decode": {"tensor_parallel_size": 2, "num_replicas": 2, **rank},
        "router": router,
    }
    with deployed(serve_url, "tp", args) as base:
        yield base


def single_process(tiny_llama: str, prompt: list[int], max_tokens: int) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [want] = LLM(tiny_llama, **ENGINE).generate([prompt], params)
    return want


def complete(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_a_tp_replica_serves_the_single_rank_tokens(
    base_url: str, tiny_llama: str, other_groups: set[str]
) -> None:
    decode = serve.get_deployment_handle("decode", app_name="tp")
    prompt = [1, 450, 7483, 310, 3444, 338]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    req = GenerateRequest(request_id="tp-0", prompt_token_ids=tuple(prompt), params=params)
    tokens = []
    for chunk in decode.options(stream=True).generate.remote(req):
        assert chunk.error is None
        tokens += chunk.token_ids
    assert tokens == single_process(tiny_llama, prompt, 16).token_ids
    created = [g for i, g in ray.util.placement_group_table().items()
               if g["state"] == "CREATED" and i not in other_groups]  # fmt: skip
    # a group of two bundles per decode replica, none for the TP-1 prefill pool
    assert sorted(len(g["bundles"]) for g in created) == [2, 2]
    generated = settled_counters(base_url, [("decode", "generation_tokens")])
    assert generated["decode generation_tokens"] >= 16
    assert pool_gauge(base_url, "kv_pages_pinned") == 0


def test_a_tp1_prefill_pool_hands_off_to_a_tp2_decode_pool(base_url: str, tiny_llama: str) -> None:
    choice = complete(base_url, PROMPT, 12)
    assert choice["text"] == single_process(tiny_llama, PROMPT, 12).text
    assert choice["finish_reason"] == "length"
    wait_until(  # the engines post their stats about once a second
        lambda: pool_counter(base_url, "kv_pages_read") > 0,
        30,
        interval_s=0.5,
        what="a KV page read by the decode pool",
    )
    assert pool_counter(base_url, "kv_transfer_recomputed") == 0  # handed off, not redone


def test_a_short_prompt_is_prefilled_by_its_decode_replica(base_url: str, tiny_llama: str) -> None:
    short = [1, 338, 3681, 29892]  # 4 tokens, and no page of it cached from PROMPT
    before = settled_counters(base_url, COUNTERS)
    assert complete(base_url, short, 6)["text"] == single_process(tiny_llama, short, 6).text
    after = settled_counters(base_url, COUNTERS)
    assert after["decode prompt_tokens"] == before["decode prompt_tokens"] + len(short)
    assert after["prefill prompt_tokens"] == before["prefill prompt_tokens"]
    assert after["decode kv_pages_read"] == before["decode kv_pages_read"]


def test_the_next_turn_reads_only_its_new_pages(base_url: str) -> None:
    before = settled_counters(base_url, COUNTERS)
    complete(base_url, TURN_1, 4)
    first = settled_counters(base_url, COUNTERS)
    assert first["decode kv_pages_read"] - before["decode kv_pages_read"] == 6  # all of it
    complete(base_url, TURN_1 + [500 + i for i in range(2 * PAGE)], 4)  # two pages more
    after = settled_counters(base_url, COUNTERS)
    assert after["decode kv_pages_reused"] - first["decode kv_pages_reused"] == 6
    assert after["decode kv_pages_read"] - first["decode kv_pages_read"] == 2
    assert after["decode kv_events_published"] > 0  # the router knew the pages from the events
