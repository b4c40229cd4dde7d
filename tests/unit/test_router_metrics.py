"""/metrics rendering: engine snapshots per role (pool replicas summed) and the push hooks."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from router.backend import RoleStats
from router.metrics import Metrics
from workers.engine_core import EngineStats


def stats(running: int, used: int, pinned: int, generated: int) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=1, kv_pages_total=100, kv_pages_used=used,
                       kv_pages_pinned=pinned, prefix_cache_queries=10, prefix_cache_hits=4,
                       num_preemptions=0, prompt_tokens_computed=6, generation_tokens=generated)


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
    text = metrics.render([RoleStats("prefill", stats(2, 30, 5, 2)),
                           RoleStats("decode", stats(3, 10, 0, 40)),
                           RoleStats("decode", stats(1, 30, 0, 60))])
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
        update={"nixl_bytes_transferred": 8192, "nixl_transfers": 2, "nixl_xfer_time_s": 0.005})
    metrics.engines.update([RoleStats("decode", decode)])
    timer = metrics.request_timer()
    timer.on_tokens(1)
    timer.on_tokens(2)
    timer.finish("length")
    text = metrics.render().decode()
    assert 'pdserve:nixl_bytes_transferred_total{model_name="m",role="decode"} 8192.0' in text
    assert 'pdserve:nixl_xfer_time_seconds_count{model_name="m",role="decode"} 2.0' in text
    assert 'pdserve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'pdserve:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'pdserve:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
