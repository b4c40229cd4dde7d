"""The KV tiers' metrics (`EngineConfig.kv_offload`), from the engines' snapshots summed per role
(`engine_metrics.role_totals`): pages and bytes each tier below the device holds, prompt tokens
found there, bytes moved down and up, the loads' time, and preemptions swapped to the tiers."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from router.metric_names import Naming

TIER_GAUGES = frozenset({"kv_host_pages", "kv_host_bytes", "kv_disk_pages", "kv_disk_bytes"})
LOWER_TIERS = ("host", "disk")


def tier_families(
    sums: dict[str, dict[str, float]], model: str, naming: Naming
) -> Iterable[Metric]:
    labels = ["model_name", naming.engine_label]
    per_tier = [*labels, "tier"]
    below = "each tier below the device holds"
    pages = GaugeMetricFamily(naming("kv_tier_pages"), f"KV pages {below}", labels=per_tier)
    nbytes = GaugeMetricFamily(naming("kv_tier_bytes"), f"KV bytes {below}", labels=per_tier)
    hits, down, up, swaps = (
        CounterMetricFamily(naming(name), doc, labels=tags)
        for name, doc, tags in (
            ("kv_tier_hit_tokens", "Prompt tokens found in a tier below the device", per_tier),
            ("kv_offload_bytes", "KV bytes copied from the device pool to host memory", labels),
            ("kv_onload_bytes", "KV bytes loaded back into the device pool", labels),
            ("num_swap_preemptions", "Preemptions whose KV went to the tiers below", labels),
        )
    )
    load_time = SummaryMetricFamily(
        naming("kv_onload_time_seconds"),
        "Time of a request's load from the tiers below (its copies, not its wait for them)",
        labels=labels,
    )
    for role, s in sorted(sums.items()):
        values = [model, role]
        for tier in LOWER_TIERS:
            pages.add_metric([*values, tier], s[f"kv_{tier}_pages"])
            nbytes.add_metric([*values, tier], s[f"kv_{tier}_bytes"])
            hits.add_metric([*values, tier], s[f"kv_{tier}_hit_tokens"])
        down.add_metric(values, s["kv_offload_bytes"])
        up.add_metric(values, s["kv_onload_bytes"])
        load_time.add_metric(values, int(s["kv_onloads"]), s["kv_onload_time_s"])
        swaps.add_metric(values, s["num_swap_preemptions"])
    return [pages, nbytes, hits, down, up, load_time, swaps]
