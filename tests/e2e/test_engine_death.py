"""A broken engine dies instead of swallowing traffic: real Ray Serve, NIXL and HTTP, SmolLM2 on
CPU. configs/local.yaml's disaggregated application with 2 decode replicas, and the sticky step
fault (`FaultConfig(point="step", action="raise")`) on one replica of each pool:
- the prefill replica's first step raises: its engine dies, every prompt goes to the decode pool
  (the prefill pool's one replica is dead), streams undisturbed;
- later a decode replica's `DECODE_AFTER`-th step raises, mid-stream for the streams it holds:
  they resume on the other decode replica.
Every greedy stream completes with the text of an undisturbed run (the same prompts again once
the faults are spent), Serve replaces both struck replicas, `engine_deaths_total` counts one
death per pool, and no page stays pinned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray

from tests.e2e.conftest import deployed, local_args
from tests.e2e.serve_metrics import sample_sum
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

APP = "deaths"
MODEL = "smollm2-135m-instruct"
FIRST = ["Count from one to ten:"]  # 1 stream: at most ~10 steps on a decode replica
DECODE_AFTER = 16  # so the decode fault strikes in the second wave, several tokens in
SECOND = [f"Write a short story about {t}." for t in ("a fox", "the sea", "a robot", "bread",
                                                       "the moon", "a lighthouse")]  # fmt: skip
MAX_TOKENS = 24
REPLACED_S = 150  # health check period (10 s) + a new SmolLM2 replica on a busy 2-core machine


@pytest.fixture(scope="module")
def base_url(serve_url: str) -> Iterator[str]:
    args = local_args("disaggregated", failover_attempts=5)
    args["engine"]["faults"] = [
        {"point": "step", "action": "raise", "role": "prefill", "after": 1},
        {"point": "step", "action": "raise", "role": "decode", "after": DECODE_AFTER},
    ]
    args["decode"].update(num_replicas=2, num_cpus_per_rank=0.25)
    args["prefill"]["num_cpus_per_rank"] = 0.25
    with deployed(serve_url, APP, args) as base:
        yield base


async def stream(c: httpx.AsyncClient, prompt: str) -> str:
    """A greedy stream's text; every token must come (the usage counts them)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, tokens = [], 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            assert '"error"' not in line, line
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += [c["text"] for c in chunk["choices"]]
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    assert tokens == MAX_TOKENS, (prompt, tokens)
    return "".join(text)


def wave(base_url: str, prompts: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
            return await asyncio.gather(*(stream(c, p) for p in prompts))

    return asyncio.run(run())


def replicas(pool: str) -> set[str]:
    prefix = f"SERVE_REPLICA::{APP}#{pool}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}  # fmt: skip


def deaths(base_url: str) -> dict[str, float]:
    return {role: sample_sum(base_url, "pdserve:engine_deaths_total", role=role,
                             cause="RuntimeError") for role in ("prefill", "decode")}  # fmt: skip


def test_a_dead_engine_is_replaced_and_no_stream_notices(base_url: str) -> None:
    started: dict[str, Any] = {pool: replicas(pool) for pool in ("prefill", "decode")}
    assert len(started["decode"]) == 2 and len(started["prefill"]) == 1
    first = wave(base_url, FIRST)  # the prefill replica dies at its first step
    second = wave(base_url, SECOND)  # then a decode replica, mid-stream
    wait_until(lambda: deaths(base_url) == {"prefill": 1, "decode": 1}, 30,
               what="a death counted in each pool")  # fmt: skip

    def replaced() -> bool:
        now = {pool: replicas(pool) for pool in started}
        return all(len(now[p]) == len(started[p]) and now[p] != started[p] for p in now)

    wait_until(replaced, REPLACED_S, interval_s=1, what="Serve replacing both struck replicas")
    assert len(replicas("decode") & started["decode"]) == 1  # the other one lives on
    assert wave(base_url, FIRST) == first and wave(base_url, SECOND) == second  # undisturbed
    assert deaths(base_url) == {"prefill": 1, "decode": 1}  # the faults are spent
    wait_until(lambda: sample_sum(base_url, "pdserve:kv_pages_pinned") == 0, 30,
               what="no page pinned")  # fmt: skip
