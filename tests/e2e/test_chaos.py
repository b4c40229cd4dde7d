"""Replicas fail under load and no stream is lost: real Ray Serve, NIXL and HTTP, the tiny random
Llama (failover is about the streams' bookkeeping, not the weights; its steps are cheap).

2 prefill + 2 decode replicas, small KV pools, faults injected through `EngineConfig.faults`
(each strikes once in the cluster, on the request whose prompt holds its marker): a prefill
replica exits after computing a prompt, then a decode replica exits mid-stream, then a KV read
fails. Each wave is concurrent greedy streams. Every stream must end as it does undisturbed (the
same prompts again once the faults are spent): every token, the same ones but where a resumed
stream met a near-tie (`tests/e2e/streams.py`); none may end in an error. Afterwards no page is
pinned on any replica.

The sticky step error (an engine whose every step raises from its n-th on: it dies, its streams
fail over, Serve replaces it) is tested end to end in `tests/e2e/test_engine_death.py`, on
SmolLM2 with every stream's exact text, a decode replica mid-stream and a prefill replica.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray.experimental import internal_kv

from tests.e2e.conftest import deployed
from tests.e2e.streams import Ask, Streamed, pinned, same_or_near_tie, wave
from tests.waiting import wait_until
from workers.disagg import faults

pytestmark = pytest.mark.e2e

MODEL = "tiny"
MAX_TOKENS = 12
DEADLINE_S = 20.0  # router.failover_deadline_s
FAULTS = [
    {"point": "prefill", "prompt_contains": "[kill prefill]"},
    {"point": "decode_token", "prompt_contains": "[kill decode]", "after": 4},
    {"point": "kv_read", "action": "fail", "prompt_contains": "[fail read]"},
]
TOPICS = ["the sea", "a red fox", "the moon", "bread"]
WAVES = [[Ask(p, MAX_TOKENS) for p in [f"Write a poem about {t}:" for t in TOPICS]
          + [f"{m} Tell me about {t}."]]
         for m, t in (("[kill prefill]", "tea"), ("[kill decode]", "rain"),
                      ("[fail read]", "snow"))]  # fmt: skip


@pytest.fixture
def base_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    pool = {"num_replicas": 2, "num_cpus_per_rank": 0.25}
    args = {
        "engine": {"model": tiny_llama, "num_kv_pages": 96, "max_model_len": 256, "faults": FAULTS},
        "served_model_name": MODEL,
        "prefill": pool,
        "decode": pool,
        "kv_transfer": {"lease_s": 10},
        "router": {"num_cpus": 0, "failover_deadline_s": DEADLINE_S, "replica_timeout_s": 15},
    }
    with deployed(serve_url, "chaos", args) as base:
        yield base


def struck() -> int:
    """Faults claimed so far in the cluster (each strikes once)."""
    return len(internal_kv._internal_kv_list("", namespace=faults.NAMESPACE))


def check_waves(base_url: str, disturbed: list[list[Streamed]], waves: list[list[Ask]]) -> None:
    """Each of `waves` again, now undisturbed: every disturbed stream ended as it does."""
    undisturbed = [wave(base_url, MODEL, asks) for asks in waves]
    for got, expected, asks in zip(disturbed, undisturbed, waves):
        assert all(w.status == 200 and len(w.tokens) == MAX_TOKENS for w in expected)
        for g, w, ask in zip(got, expected, asks):
            assert same_or_near_tie(g, w), (ask.prompt, g.status, g.error, g.tokens, w.tokens)
    wait_until(lambda: pinned(base_url) == 0, 60, interval_s=1, what="no page pinned")


def test_no_stream_is_lost_when_replicas_fail(base_url: str) -> None:
    before = struck()
    disturbed = [wave(base_url, MODEL, asks) for asks in WAVES]
    assert struck() == before + len(FAULTS)  # each fault did strike, once
    check_waves(base_url, disturbed, WAVES)
