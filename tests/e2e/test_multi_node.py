"""Disaggregated serving across Ray nodes: the shared cluster is three nodes on this machine
(`tests/ray_nodes.py`), and the shared disaggregated app pins its prefill pool and its decode pool
to different worker nodes through `PoolConfig.resources` (`tests/e2e/conftest.py`). The replicas
sit where their resources say; the OpenAI path answers the tokens of the single-process engine
(the colocated app's one replica) with the KV read over NIXL from the other node; no page stays
pinned after."""

from __future__ import annotations

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DECODE_NODE, PREFILL_NODE
from tests.e2e.serve_metrics import pool_counter
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

APP = "disaggregated"
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 8
# a prompt of several pages that no other module sends (the decode replica must read it all)
PROMPT = "Across the nodes, the prefill replica computes these pages for the decode one. " * 6


def replica_nodes(pool: str) -> set[str]:
    """The node ids of `pool`'s replicas (Serve names each replica's actor after its app and
    deployment), asked of the replicas themselves."""
    prefix = f"SERVE_REPLICA::{APP}#{pool}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].startswith(prefix)]  # fmt: skip
    assert names, f"no replica of {pool}"
    actors = [ray.get_actor(name, namespace="serve") for name in names]
    where = lambda _: ray.get_runtime_context().get_node_id()  # noqa: E731 - runs in the replica
    return set(ray.get([a.__ray_call__.remote(where) for a in actors]))


def pinned_pages(base: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text)
    return {s.labels["role"]: s.value for f in families if f.name == "pdserve:kv_pages_pinned"
            for s in f.samples}  # fmt: skip


def test_the_pools_run_on_the_nodes_their_resources_name(local_apps: dict[str, str]) -> None:
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(resources) == 3
    prefill, decode = replica_nodes("prefill"), replica_nodes("decode")
    assert not prefill & decode
    assert all(PREFILL_NODE in resources[node] for node in prefill)
    assert all(DECODE_NODE in resources[node] for node in decode)


def completion_tokens(base: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [
        int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]
    ]


def test_tokens_cross_nodes_equal_the_single_process_engine(local_apps: dict[str, str]) -> None:
    """The colocated app is the single-process engine: one replica prefills and decodes."""
    base = local_apps[APP]
    ids = [int(t) for t in httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": PROMPT},
                                      timeout=30).json()["tokens"]]  # fmt: skip
    read_before = pool_counter(base, "nixl_bytes_transferred")
    tokens = completion_tokens(base, ids)
    assert len(tokens) == MAX_TOKENS and tokens == completion_tokens(local_apps["colocated"], ids)
    # the decode replica read the prompt's KV from the prefill node (its counters post ~1/s)
    wait_until(lambda: pool_counter(base, "nixl_bytes_transferred") > read_before, 30,
               interval_s=0.5, what="the decode pool's NIXL bytes to grow")  # fmt: skip
    wait_until(lambda: set(pinned_pages(base).values()) == {0.0}, 30, interval_s=0.5,
               what="no KV page pinned on either pool")  # fmt: skip
