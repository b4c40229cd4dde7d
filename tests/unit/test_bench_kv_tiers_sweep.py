"""The KV-tier benchmark's rate sweep keeps the highest rate answered without a queue: the H200
sweep's points (bench/results/kv-tiers_h200_2026-12-06.json), where 24 turns/s was answered at
99% of the offered rate while later turns waited 29x as long as at 16."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_kv_tiers import kept_rate

RESULT = Path(__file__).parents[2] / "bench/results/kv-tiers_h200_2026-12-06.json"


def test_a_rate_whose_later_turns_queue_is_not_kept() -> None:
    points = json.loads(RESULT.read_text())["measured"]["host_tier_rate_sweep"]
    assert [p["rate_per_s"] for p in points] == [16.0, 24.0]
    assert kept_rate(points) == 16.0


def test_the_highest_calm_rate_is_kept_and_an_overloaded_one_is_not() -> None:
    points = [
        dict(rate_per_s=16.0, completed_per_s=16.1, later_ttft_p50_ms=40.0),
        dict(rate_per_s=20.0, completed_per_s=19.9, later_ttft_p50_ms=90.0),
        dict(rate_per_s=28.0, completed_per_s=24.0, later_ttft_p50_ms=100.0),  # under 95%
    ]
    assert kept_rate(points) == 20.0
    assert kept_rate(points[2:]) == 28.0  # nothing kept: the lowest rate
