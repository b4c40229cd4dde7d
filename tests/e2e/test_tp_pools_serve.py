"""Prefill and decode pools of different TP sizes in real Ray Serve, called over HTTP: the
application `build_app` makes of a config with a TP-1 prefill pool and a TP-2 decode pool. Each
decode rank reads its KV head from the one prefill rank (staged); the answer must be the
single-process engine's. Prompts of at most 4 tokens skip the prefill pool
(`router.decode_prefill_max_tokens`): the TP-2 decode group prefills them itself."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import deployed
from tests.e2e.serve_metrics import pool_counter, settled_counters
from tests.waiting import wait_until
from workers import LLM, SamplingParams

pytestmark = pytest.mark.e2e

ENGINE = {"num_kv_pages": 64, "page_size": 4}
PROMPT = [1, 450, 7483, 310, 3444, 338, 3681, 29892, 1]
COUNTERS = [("decode", "prompt_tokens"), ("prefill", "prompt_tokens"), ("decode", "kv_pages_read")]


@pytest.fixture(scope="module")
def base_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    rank = {"num_cpus_per_rank": 0.5}
    args = {
        "engine": {"model": tiny_llama, **ENGINE},
        "served_model_name": "tiny",
        "prefill": {"tensor_parallel_size": 1, **rank},
        "decode": {"tensor_parallel_size": 2, **rank},
        "router": {"num_cpus": 0.5, "decode_prefill_max_tokens": 4},
    }
    with deployed(serve_url, "tp-pools", args) as base:
        yield base


def test_a_tp1_prefill_pool_hands_off_to_a_tp2_decode_pool(base_url: str, tiny_llama: str) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{base_url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [want] = LLM(tiny_llama, **ENGINE).generate([PROMPT], params)
    choice = reply.json()["choices"][0]
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
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
    body = {"model": "tiny", "prompt": short, "max_tokens": 6, "temperature": 0}
    reply = httpx.post(f"{base_url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [want] = LLM(tiny_llama, **ENGINE).generate([short], params)
    assert reply.json()["choices"][0]["text"] == want.text
    after = settled_counters(base_url, COUNTERS)
    assert after["decode prompt_tokens"] == before["decode prompt_tokens"] + len(short)
    assert after["prefill prompt_tokens"] == before["prefill prompt_tokens"]
    assert after["decode kv_pages_read"] == before["decode kv_pages_read"]
