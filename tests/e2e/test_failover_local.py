"""The default cluster's shape (configs/local.yaml: SmolLM2, 1 prefill + 1 decode replica) loses no
stream to one replica's death: real Ray Serve, NIXL and HTTP.

- The decode replica exits mid-stream under 10 concurrent greedy streams: with no decode replica
  left, the prefill replica resumes each from the tokens already sent, and every stream ends
  byte-identical to an undisturbed run. One of them is long: it streams on well past
  `failover_deadline_s` after the death (the deadline bounds the wait for an engine to take it,
  never a stream that makes progress).
- The prefill replica exits after computing a prompt, under 10 concurrent streams: the decode
  replica prefills them itself (a busy replica, not a dead one), and every stream ends
  byte-identical.
The undisturbed run is the same prompts on the shared colocated configs/local.yaml application
(`local_apps`, tests/e2e/conftest.py), so no test waits for a replacement replica to compare;
the prefill-kill test waits for the application to be healthy again (the decode replica the
first test killed replaced) before it strikes. Afterwards no page is pinned.
- A prefill replica that is never scheduled (no node has its resources): a chat is answered by
  the decode replica prefilling it, at once, not after `replica_timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from ray import serve
from ray.experimental import internal_kv
from ray.serve import api as serve_api

from cluster.app import build_app
from tests.e2e.conftest import deployed, local_args, wait_healthy
from tests.e2e.serve_metrics import settled_counters
from tests.e2e.streams import Ask, Streamed, pinned, wave
from tests.waiting import wait_until
from workers.disagg import faults

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
# Above the stats board's staleness bound (3 s) and its poll (1 s): the router sees the dead
# pool and moves the streams to the other engine within it.
DEADLINE_S = 6.0
MAX_TOKENS = 24
LONG_TOKENS = 160  # ~15 s of decoding on 2 busy cores: well past DEADLINE_S after the death
# Markers of their own: a fault is claimed by its config's hash, cluster-wide, and
# tests/e2e/test_chaos.py's faults may have struck already in the same test run.
FAULTS = [
    {"point": "decode_token", "prompt_contains": "[pd: kill decode]", "after": 8},
    {"point": "prefill", "prompt_contains": "[pd: kill prefill]"},
]
TOPICS = ["the sea", "a red fox", "the moon", "bread", "a lighthouse", "winter", "a violin",
          "the desert"]  # fmt: skip


def asks(marker: str, long: bool = False) -> list[Ask]:
    """10 streams: 8 short ones, the one whose prompt holds `marker`, and a last one (long)."""
    short = [Ask(f"Write a short story about {t}.", MAX_TOKENS) for t in TOPICS]
    last = Ask("Explain how a steam engine works.", LONG_TOKENS if long else MAX_TOKENS)
    return [*short, Ask(f"{marker} Tell me about rain.", MAX_TOKENS), last]


def running_replicas(app: str, deployment: str) -> int:
    app_status = serve.status().applications.get(app)
    if app_status is None or deployment not in app_status.deployments:
        return 0
    return app_status.deployments[deployment].replica_states.get("RUNNING", 0)


def test_a_prefill_pool_never_scheduled_leaves_prefill_to_decode_at_once(serve_url: str) -> None:
    """configs/local.yaml with a prefill replica that no node can hold: /health stays 503, yet a
    chat is answered by the decode replica in seconds (it waited replica_timeout_s, then 503)."""
    name = "pd-no-prefill"
    args = local_args("disaggregated")
    args["prefill"]["resources"] = {"pd_no_such_node": 1}
    serve_api._run(build_app(args), _blocking=False, name=name, route_prefix=f"/{name}")
    try:
        wait_until(lambda: running_replicas(name, "decode") and running_replicas(name, "router"),
                   180, interval_s=1, what="the decode replica and the router up")  # fmt: skip
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": chat}
        t0 = time.monotonic()
        r = httpx.post(f"{serve_url}/{name}/v1/chat/completions", json=body, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"], r.json()
        assert took < 15, took  # replica_timeout_s is 60
        assert running_replicas(name, "prefill") == 0  # it was never there
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def base_url(serve_url: str) -> Iterator[str]:
    args = local_args("disaggregated", failover_deadline_s=DEADLINE_S)
    args["engine"]["faults"] = FAULTS
    with deployed(serve_url, "pd-failover", args) as base:
        wait_healthy(base)
        yield base


def check_identical(got: list[Streamed], want: list[Streamed], sent: list[Ask]) -> None:
    for g, w, ask in zip(got, want, sent):
        assert w.status == 200 and len(w.tokens) == ask.max_tokens, (ask.prompt, w.error)
        assert g.status == 200, (ask.prompt, g.status, g.error)
        assert (g.tokens, g.text) == (w.tokens, w.text), (ask.prompt, g.text, w.text)


def struck() -> int:
    """Faults claimed so far in the cluster (each strikes once)."""
    return len(internal_kv._internal_kv_list("", namespace=faults.NAMESPACE))


def prefill_generated(base_url: str) -> float:
    counters = settled_counters(base_url, [("prefill", "generation_tokens")])
    return counters["prefill generation_tokens"]


def test_a_decode_death_loses_no_stream_even_a_long_one(
    base_url: str, local_apps: dict[str, str]
) -> None:
    sent = asks("[pd: kill decode]", long=True)
    before, generated = struck(), prefill_generated(base_url)
    got = wave(base_url, MODEL, sent)
    assert struck() == before + 1
    # the prefill replica decoded the streams on: more than one token a request
    assert prefill_generated(base_url) - generated > 2 * len(sent)
    want = wave(local_apps["colocated"], MODEL, sent)
    check_identical(got, want, sent)
    # the long stream outlived the deadline after the death (at its 8th token, seconds in)
    print(f"long stream: {got[-1].took:.1f} s")
    assert got[-1].took > 2 * DEADLINE_S, got[-1].took
    wait_until(lambda: pinned(base_url) == 0, 60, interval_s=1, what="no page pinned")


def test_a_prefill_death_loses_no_stream(base_url: str, local_apps: dict[str, str]) -> None:
    wait_healthy(base_url)  # both pools live: an earlier test may have killed a replica
    sent = asks("[pd: kill prefill]")
    before = struck()
    got = wave(base_url, MODEL, sent)
    assert struck() == before + 1
    want = wave(local_apps["colocated"], MODEL, sent)
    check_identical(got, want, sent)
    wait_until(lambda: pinned(base_url) == 0, 60, interval_s=1, what="no page pinned")
