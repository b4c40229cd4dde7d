"""Reading the engines' counters off a running app's /metrics (shared by the Serve tests)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_settled


def pool_counter(base_url: str, name: str, role: str = "decode") -> float:
    """A pool's `pdserve:<name>_total`, as /metrics reports it (its replicas summed)."""
    return pool_gauge(base_url, f"{name}_total", role)


def pool_gauge(base_url: str, name: str, role: str = "decode") -> float:
    """A pool's `pdserve:<name>`, as /metrics reports it (its replicas summed)."""
    return sample_sum(base_url, f"pdserve:{name}", role=role)


def sample_sum(base_url: str, name: str, **labels: str) -> float:
    """The sum of a /metrics sample's values over those carrying `labels` (0 if none)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def settled_counters(base_url: str, keys: list[tuple[str, str]]) -> dict[str, float]:
    """The (role, name) counters, keyed "role name", once two readings 1.5 s apart agree (the
    engines post their stats about once a second)."""
    return wait_settled(
        lambda: {f"{r} {n}": pool_counter(base_url, n, r) for r, n in keys},
        1.5,
        30,
        what="the pools' counters",
    )
