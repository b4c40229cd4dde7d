"""The router's request metrics as posted and summed: `RequestStats`, and their rendering.

One router replica's `RequestStats` are cumulative since it started; /metrics adds the other
replicas' posts (`router/metrics_board.py`) to this replica's live values and renders the sum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel

from router.metric_names import REQUEST_HISTOGRAMS, Naming

logger = logging.getLogger(__name__)


class HistogramCounts(BaseModel):
    """One histogram's cumulative state: a count per bucket bound (+Inf last) and the sum."""

    buckets: list[float]
    sum: float = 0.0

    def __add__(self, other: HistogramCounts) -> HistogramCounts:
        if len(other.buckets) != len(self.buckets):  # a replica with other buckets: skip it
            logger.warning(
                "histogram with %d buckets, expected %d: left out",
                len(other.buckets),
                len(self.buckets),
            )
            return self
        buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        return HistogramCounts(buckets=buckets, sum=self.sum + other.sum)


class RequestStats(BaseModel):
    """One router replica's request metrics, cumulative since it started: what it posts."""

    histograms: dict[str, HistogramCounts]  # REQUEST_HISTOGRAMS key -> counts
    success: dict[str, float]  # finished_reason -> requests
    rejected: dict[str, float] = {}  # reason -> requests turned away
    errors: dict[str, float] = {}  # kind -> admitted requests that ended in an error

    def __add__(self, other: RequestStats) -> RequestStats:
        mine, theirs = self.histograms, other.histograms
        histograms = {k: mine[k] + theirs[k] if k in mine and k in theirs else
                      mine.get(k) or theirs[k] for k in mine.keys() | theirs.keys()}
        return RequestStats(
            histograms=histograms,
            success=_add_counts(self.success, other.success),
            rejected=_add_counts(self.rejected, other.rejected),
            errors=_add_counts(self.errors, other.errors),
        )


def _add_counts(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


SUCCESS = ("request_success", "Finished requests by reason")
REJECTED = ("request_rejected", "Requests turned away by admission control (429), by reason")
ERRORS = ("request_errors", "Admitted requests that ended in an error, once each, by kind")


class RequestStatsCollector(Collector):
    """Renders `live()` (this replica's request metrics) plus the other router replicas'
    (`peers`), under `naming`'s names and labels."""

    def __init__(self, live: Callable[[], RequestStats], naming: Naming, model_name: str,
                 buckets: Mapping[str, tuple[float, ...]]) -> None:
        self.live, self.naming, self.buckets = live, naming, buckets
        self.labels = naming.request_labels(model_name)
        self.peers: list[RequestStats] = []

    def collect(self) -> Iterable[Metric]:
        total = self.live()
        for peer in self.peers:
            total = total + peer
        names, values = list(self.labels), list(self.labels.values())
        for key, (family, doc, _) in REQUEST_HISTOGRAMS.items():
            counts = total.histograms.get(key)
            bounds = (*self.buckets[key], float("inf"))
            if counts is None or len(counts.buckets) != len(bounds):
                counts = HistogramCounts(buckets=[0.0] * len(bounds))
            metric = HistogramMetricFamily(self.naming(family), doc, labels=names)
            les = [floatToGoString(b) for b in bounds]
            metric.add_metric(values, list(zip(les, counts.buckets, strict=True)), counts.sum)
            yield metric
        for (family, doc), label, totals in (
            (SUCCESS, "finished_reason", total.success),
            (REJECTED, "reason", total.rejected),
            (ERRORS, "kind", total.errors),
        ):
            counter = CounterMetricFamily(self.naming(family), doc, labels=[*names, label])
            for value, n in totals.items():
                counter.add_metric([*values, value], n)
            yield counter
