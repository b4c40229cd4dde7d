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
The undisturbed run is the same prompts again once the fault is spent and the replica replaced.
Afterwards no page is pinned.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray.experimental import internal_kv

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
FAULTS = [
    {"point": "decode_token", "prompt_contains": "[kill decode]", "after": 8},
    {"point": "prefill", "prompt_contains": "[kill prefill]"},
]
TOPICS = ["the sea", "a red fox", "the moon", "bread", "a lighthouse", "winter", "a violin",
          "the desert"]  # fmt: skip


def asks(marker: str, long: bool = False) -> list[Ask]:
    """10 streams: 8 short ones, the one whose prompt holds `marker`, and a last one (long)."""
    short = [Ask(f"Write a short story about {t}.", MAX_TOKENS) for t in TOPICS]
    last = Ask("Explain how a steam engine works.", LONG_TOKENS if long else MAX_TOKENS)
    return [*short, Ask(f"{marker} Tell me about rain.", MAX_TOKENS), last]


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


def test_a_decode_death_loses_no_stream_even_a_long_one(base_url: str) -> None:
    sent = asks("[kill decode]", long=True)
    before, generated = struck(), prefill_generated(base_url)
    got = wave(base_url, MODEL, sent)
    assert struck() == before + 1
    # the prefill replica decoded the streams on: more than one token a request
    assert prefill_generated(base_url) - generated > 2 * len(sent)
    wait_healthy(base_url)  # the replacement decode replica
    want = wave(base_url, MODEL, sent)
    check_identical(got, want, sent)
    # the long stream outlived the deadline after the death (at its 8th token, seconds in)
    print(f"long stream: {got[-1].took:.1f} s")
    assert got[-1].took > 2 * DEADLINE_S, got[-1].took
    wait_until(lambda: pinned(base_url) == 0, 60, interval_s=1, what="no page pinned")


def test_a_prefill_death_loses_no_stream(base_url: str) -> None:
    sent = asks("[kill prefill]")
    before = struck()
    got = wave(base_url, MODEL, sent)
    assert struck() == before + 1
    wait_healthy(base_url)  # the replacement prefill replica
    want = wave(base_url, MODEL, sent)
    check_identical(got, want, sent)
    wait_until(lambda: pinned(base_url) == 0, 60, interval_s=1, what="no page pinned")
