"""/metrics rendering: engine snapshots per role (pool replicas summed) and the push hooks."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.backend import RoleStats
from router.metrics import Metrics, RequestStats
from workers.protocol import EngineStats


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
    name = metrics.model_name
    metrics.ttft.labels(name).observe(ttft)
    for gap in gaps:
        metrics.itl.labels(name).observe(gap)
    metrics.e2e.labels(name).observe(e2e)
    metrics.success.labels(name, reason).inc()


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
    assert stats.ttft.buckets[-1] == 1 and stats.success["error"] == 1
