"""/metrics rendering: engine snapshots per role (pool replicas summed) and the push hooks; the
stats board's staleness, and what faults do to the metrics."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.backend import RoleStats
from router.errors import APIError
from router.metric_names import Naming
from router.metrics import ERROR_KINDS, Metrics, RequestStats, error_kind
from tests.waiting import wait_until
from workers.engine_stats import EngineStats
from workers.serve import stats_board


def stats(running: int, used: int, pinned: int, generated: int) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_waiting=1,
        kv_pages_total=100,
        kv_pages_used=used,
        kv_pages_pinned=pinned,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_preemptions=0,
        prompt_tokens_computed=6,
        generation_tokens=generated,
    )


def samples(text: bytes) -> dict[tuple[str, str], float]:
    """(sample name, role) -> value, for the samples that carry a role."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if "role" in s.labels:
                out[(s.name, s.labels["role"])] = s.value
    return out


def test_decode_replicas_are_summed_and_roles_kept_apart() -> None:
    metrics = Metrics("m")
    text = metrics.render(
        [
            RoleStats("prefill", stats(2, 30, 5, 2)),
            RoleStats("decode", stats(3, 10, 0, 40)),
            RoleStats("decode", stats(1, 30, 0, 60)),
        ]
    )
    got = samples(text)
    assert got[("pdserve:num_requests_running", "prefill")] == 2
    assert got[("pdserve:num_requests_running", "decode")] == 4
    assert got[("pdserve:num_requests_waiting", "decode")] == 2
    assert got[("pdserve:kv_cache_usage_perc", "decode")] == 40 / 200
    assert got[("pdserve:kv_pages_pinned", "prefill")] == 5
    assert got[("pdserve:generation_tokens_total", "decode")] == 100
    assert got[("pdserve:prefix_cache_hits_total", "prefill")] == 4
    assert got[("pdserve:nixl_bytes_transferred_total", "prefill")] == 0


@pytest.mark.parametrize("prefix, label", [("pdserve", "role"), ("vllm", "engine")])
def test_speculative_decoding_counters_as_vllm_names_them(prefix: str, label: str) -> None:
    """Drafts and accepted tokens summed over the decode replicas (per position too, replicas of
    different k); a pool that does not speculate has none, nor has an app where none does."""
    spec = {"spec_num_drafts": 5, "spec_num_draft_tokens": 20, "spec_num_accepted_tokens": 9}
    decode = [
        stats(1, 10, 0, 40).model_copy(update={**spec, "spec_accepted_per_pos": [4, 3, 2]}),
        stats(1, 10, 0, 40).model_copy(update={**spec, "spec_accepted_per_pos": [5, 4]}),
    ]
    metrics = Metrics("m", naming=Naming(prefix))  # type: ignore[arg-type]
    text = metrics.render([RoleStats("prefill", stats(2, 30, 5, 2))]
                          + [RoleStats("decode", s) for s in decode])  # fmt: skip
    got = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if "spec_decode" in sample.name:
                got[(sample.name, sample.labels[label], sample.labels.get("position"))] = (
                    sample.value
                )
    name = f"{prefix}:spec_decode_num"
    assert got == {
        (f"{name}_drafts_total", "decode", None): 10,
        (f"{name}_draft_tokens_total", "decode", None): 40,
        (f"{name}_accepted_tokens_total", "decode", None): 18,
        (f"{name}_accepted_tokens_per_pos_total", "decode", "0"): 9,
        (f"{name}_accepted_tokens_per_pos_total", "decode", "1"): 7,
        (f"{name}_accepted_tokens_per_pos_total", "decode", "2"): 2,
    }
    assert b"spec_decode" not in Metrics("m").render([RoleStats("decode", stats(1, 1, 0, 1))])


def test_nixl_transfers_and_request_timers_are_recorded() -> None:
    metrics = Metrics("m")
    decode = stats(1, 1, 0, 1).model_copy(
        update={
            "nixl_bytes_transferred": 8192,
            "nixl_transfers": 2,
            "nixl_xfer_time_s": 0.005,
            "kv_pages_read": 2,
            "kv_pages_reused": 3,
            "num_recomputed": 1,
        }
    )
    metrics.engines.update([RoleStats("decode", decode)])
    timer = metrics.request_timer()
    timer.on_tokens(1)
    timer.on_tokens(2)
    timer.finish("length")
    text = metrics.render().decode()
    assert 'pdserve:nixl_bytes_transferred_total{model_name="m",role="decode"} 8192.0' in text
    assert 'pdserve:nixl_xfer_time_seconds_count{model_name="m",role="decode"} 2.0' in text
    assert 'pdserve:kv_pages_read_total{model_name="m",role="decode"} 2.0' in text
    assert 'pdserve:kv_pages_reused_total{model_name="m",role="decode"} 3.0' in text
    assert 'pdserve:kv_transfer_recomputed_total{model_name="m",role="decode"} 1.0' in text
    assert 'pdserve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'pdserve:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'pdserve:request_success_total{finished_reason="length",model_name="m"} 1.0' in text


def observe(metrics: Metrics, ttft: float, gaps: list[float], e2e: float, reason: str) -> None:
    metrics.observe("ttft", ttft)
    for gap in gaps:
        metrics.observe("itl", gap)
    metrics.observe("e2e", e2e)
    metrics.success.labels(**metrics.labels, finished_reason=reason).inc()


def request_samples(text: bytes) -> dict[tuple[str, str], float]:
    """(sample name, le or finished_reason) -> value, for the router's request metrics."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name.startswith(
            ("pdserve:time_to", "pdserve:inter", "pdserve:e2e", "pdserve:request_success")
        ):
            for s in family.samples:
                key = s.labels.get("le", s.labels.get("finished_reason", ""))
                out[(s.name, key)] = s.value
    return out


def test_other_router_replicas_are_added_to_this_ones_request_metrics() -> None:
    a, b = Metrics("m"), Metrics("m")
    observe(a, 0.003, [0.02, 0.3], 1.2, "stop")
    observe(a, 0.07, [], 9.0, "length")
    observe(b, 0.5, [0.02, 0.02, 6.0], 30.0, "stop")
    observe(b, 3.0, [0.09], 0.4, "abort")
    alone_a, alone_b = request_samples(a.render()), request_samples(b.render())
    merged = request_samples(a.render(peers=[b.request_stats()]))
    assert merged.keys() == alone_a.keys() == alone_b.keys()
    for key, value in merged.items():
        assert value == pytest.approx(alone_a[key] + alone_b[key]), key
    assert merged[("pdserve:time_to_first_token_seconds_count", "")] == 4
    assert merged[("pdserve:time_to_first_token_seconds_bucket", "0.5")] == 3
    assert merged[("pdserve:inter_token_latency_seconds_bucket", "+Inf")] == 6
    assert merged[("pdserve:e2e_request_latency_seconds_sum", "")] == pytest.approx(40.6)
    assert merged[("pdserve:request_success_total", "stop")] == 2
    assert merged[("pdserve:request_success_total", "abort")] == 1
    # Outside Ray there are no peers: a render without them shows this replica alone again.
    assert request_samples(a.render(peers=[])) == alone_a


def test_posted_request_stats_round_trip_through_json() -> None:
    metrics = Metrics("m")
    observe(metrics, 0.2, [0.01], 2.0, "error")
    stats = metrics.request_stats()
    assert RequestStats.model_validate_json(stats.model_dump_json()) == stats
    assert stats.histograms["ttft"].buckets[-1] == 1 and stats.success["error"] == 1


# ---- after faults: a dead replica's gauges go, counters never go down, errors counted once ----
def test_a_dead_replicas_gauges_drop_out_and_its_counters_stay() -> None:
    text = Metrics("m").render(
        [
            RoleStats("decode", stats(3, 10, 2, 40), live=False),
            RoleStats("decode", stats(1, 30, 0, 60)),
            RoleStats("prefill", stats(1, 20, 2, 5), live=False),  # no live prefill replica
        ]
    )
    got = samples(text)
    assert got[("pdserve:num_requests_running", "decode")] == 1
    assert got[("pdserve:kv_pages_pinned", "decode")] == 0
    assert got[("pdserve:kv_cache_usage_perc", "decode")] == 30 / 100
    assert got[("pdserve:generation_tokens_total", "decode")] == 100
    assert got[("pdserve:num_requests_running", "prefill")] == 0  # what is known: nothing runs
    assert got[("pdserve:kv_pages_pinned", "prefill")] == 0
    assert got[("pdserve:generation_tokens_total", "prefill")] == 5


@pytest.mark.parametrize(("prefix", "label"), [("pdserve", "role"), ("vllm", "engine")])
def test_engine_deaths_count_by_pool_and_cause_and_a_dead_replicas_stay(
    prefix: str, label: str
) -> None:
    dead = stats(0, 0, 0, 40).model_copy(update={"engine_deaths": {"RuntimeError": 1}})
    text = Metrics("m", naming=Naming(prefix)).render(
        [
            RoleStats("decode", dead, live=False),  # replaced: its last post stays counted
            RoleStats("decode", dead),  # another, just died, still posting
            RoleStats("decode", stats(1, 30, 0, 60)),
            RoleStats("prefill", stats(1, 20, 0, 5)),
        ]
    )
    deaths = {(s.labels[label], s.labels["cause"]): s.value
              for f in text_string_to_metric_families(text.decode()) for s in f.samples
              if s.name == f"{prefix}:engine_deaths_total"}  # fmt: skip
    assert deaths == {("decode", "RuntimeError"): 2}


def test_totals_never_decrease_while_a_replica_is_replaced() -> None:
    """The board's entries over time, as `DisaggregatedBackend.stats` reads them: r1 serves, is
    killed (its entry goes stale), r2 starts from 0; every rendered total is monotonic."""
    r1_dead = RoleStats("decode", stats(2, 5, 1, 55), live=False)  # its last post
    timeline = [
        [RoleStats("decode", stats(2, 5, 1, 40))],
        [RoleStats("decode", stats(2, 5, 1, 55))],
        [r1_dead],  # r1 killed
        [r1_dead, RoleStats("decode", stats(0, 0, 0, 0))],  # r2 up
        [r1_dead, RoleStats("decode", stats(1, 3, 1, 7))],
    ]
    metrics = Metrics("m")
    totals = [samples(metrics.render(s))[("pdserve:generation_tokens_total", "decode")]
              for s in timeline]
    assert totals == [40, 55, 55, 55, 62]
    running = [samples(metrics.render(s))[("pdserve:num_requests_running", "decode")]
               for s in timeline]
    assert running == [2, 2, 0, 0, 1]


def test_error_kinds_follow_the_status_the_client_got() -> None:
    assert [error_kind(s) for s in (400, 413, 500, 502, 503, None)] == [
        "invalid", "invalid", "internal", "internal", "unavailable", "abort"
    ]


def errors(text: bytes) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text.decode())
        if family.name == "pdserve:request_errors"
        for s in family.samples
    }


def test_a_failed_request_is_counted_once_whoever_sees_it_and_peers_add_up() -> None:
    metrics = Metrics("m")
    assert errors(metrics.render()) == dict.fromkeys(ERROR_KINDS, 0.0)  # exported at 0
    with pytest.raises(APIError), metrics.outcome() as outcome:
        outcome.failed(503)  # the stream saw it first ...
        raise APIError("no replica", status=503)  # ... then the handler
    with pytest.raises(ConnectionError), metrics.outcome():
        raise ConnectionError("lost")
    with metrics.outcome():
        pass  # a success counts nothing
    other = Metrics("m")
    with pytest.raises(asyncio.CancelledError), other.outcome():
        raise asyncio.CancelledError  # the client went away
    got = errors(metrics.render(peers=[other.request_stats()]))
    assert got == {"invalid": 0, "unavailable": 1, "internal": 1, "abort": 1}
    assert RequestStats.model_validate_json(other.request_stats().model_dump_json()).errors[
        "abort"
    ] == 1


# ---- the stats board: staleness on a fake clock ------------------------------------------------
class FakeKV:
    """Ray's internal KV API, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def _internal_kv_put(self, key: str, value: bytes, overwrite: bool, namespace: str) -> None:
        self.data[key] = value

    def _internal_kv_get(self, key: bytes, namespace: str) -> bytes | None:
        return self.data.get(key.decode())

    def _internal_kv_list(self, prefix: str, namespace: str) -> list[bytes]:
        return [k.encode() for k in self.data if k.startswith(prefix)]


@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> FakeKV:
    fake = FakeKV()
    monkeypatch.setattr(stats_board, "ray_internal_kv", lambda: fake)
    return fake


def test_a_replica_is_live_until_it_misses_three_posts_and_then_kept(kv: FakeKV) -> None:
    clock = [1000.0]
    poster = stats_board.StatsPoster("app", "decode", "r1", clock=lambda: clock[0])
    assert poster(stats(1, 1, 0, 7))
    clock[0] += 0.5
    assert not poster(stats(2, 1, 0, 8))  # within the interval
    assert poster(stats(3, 1, 0, 9), force=True)  # a scrape's own post goes at once

    def read(at: float) -> list[tuple[int, bool]]:
        posted = stats_board.read_pool("app", "decode", at)
        return [(p.stats.generation_tokens, p.live) for p in posted]

    assert read(1000.5 + stats_board.STALE_AFTER_S - 0.01) == [(9, True)]
    assert read(1000.5 + stats_board.STALE_AFTER_S) == [(9, False)]  # dead: kept, not live
    assert stats_board.STALE_AFTER_S <= 3 * stats_board.POST_INTERVAL_S
    assert stats_board.read_pool("other", "decode", 0) == []
    poster.close()  # its heartbeat would post into later tests' boards


def test_a_replica_that_posts_nothing_new_keeps_its_heartbeat(kv: FakeKV) -> None:
    """A replica busy in one long step (or idle) hands over no new snapshot: its heartbeat
    thread posts the last one again, so it stays live under load."""
    poster = stats_board.StatsPoster("app", "prefill", "busy")
    try:
        assert poster(stats(1, 1, 0, 1))
        first = json.loads(kv.data["app/prefill/busy"])["time"]
        wait_until(
            lambda: json.loads(kv.data["app/prefill/busy"])["time"] > first,
            3 * stats_board.POST_INTERVAL_S,
            interval_s=0.05,
            what="a heartbeat post",
        )
        [posted] = stats_board.read_pool("app", "prefill")
        assert posted.live and posted.stats.num_running == 1
    finally:
        poster.close()
    last = kv.data["app/prefill/busy"]
    time.sleep(2.5 * stats_board.POST_INTERVAL_S)  # the behaviour: no beat after close()
    assert kv.data["app/prefill/busy"] == last
