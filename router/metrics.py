"""Prometheus metrics under `pdserve:`, named after vLLM's so dashboards carry over.

Two sources feed them:
- engine snapshots (`RoleStats`), taken by the /metrics handler from `GenerationBackend.stats()`
  just before rendering: the gauges and the engine's own counters, labelled with `role`. Several
  engines of one role (a pool's replicas) are summed: the counters over every replica that ever
  posted (a dead one's last values stay, so a total never goes down when Serve replaces a
  replica), the gauges over the live ones only. `prompt_tokens_total` counts prompt tokens
  the engines computed (prefix-cache hits are counted by `prefix_cache_hits_total` instead);
- push hooks called while requests run: the latency histograms and `request_success_total`
  (through `RequestTimer`, one per choice; a failed request's choices end as "error", a client
  gone as "abort"), `request_rejected_total` (admission control, `router/admission.py`: requests
  answered 429, by reason: the router's queue or a pool's), `request_errors_total` (an admitted
  request that ended in an error, once per HTTP request, by kind: `ERROR_KINDS`). NIXL hand-off
  counters come with the snapshots: the decode engines count the KV they read.
A scrape reaches one router replica, so the request metrics are rendered as this replica's live
values plus the other router replicas' posted `RequestStats` (`router/metrics_board.py`), dead
ones' last posts included.
Each app gets its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel

from router.backend import RoleStats
from router.engine_metrics import PREFIX, EngineStatsCollector
from router.errors import APIError

logger = logging.getLogger(__name__)

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
XFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0, 10.0)
# fmt: on

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

    ttft: HistogramCounts
    itl: HistogramCounts
    e2e: HistogramCounts
    success: dict[str, float]  # finished_reason -> requests
    rejected: dict[str, float] = {}  # reason -> requests turned away
    errors: dict[str, float] = {}  # kind -> admitted requests that ended in an error

    def __add__(self, other: RequestStats) -> RequestStats:
        return RequestStats(
            ttft=self.ttft + other.ttft,
            itl=self.itl + other.itl,
            e2e=self.e2e + other.e2e,
            success=_add_counts(self.success, other.success),
            rejected=_add_counts(self.rejected, other.rejected),
            errors=_add_counts(self.errors, other.errors),
        )


def _add_counts(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


# RequestStats field -> (metric name without prefix, help, buckets)
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Time between tokens", ITL_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "Request latency", E2E_BUCKETS),
}
SUCCESS = ("request_success", "Finished requests by reason")
REJECTED = ("request_rejected", "Requests turned away by admission control (429), by reason")
ERRORS = ("request_errors", "Admitted requests that ended in an error, once each, by kind")
# kind -> what ended the request; `error_kind` maps the HTTP status the client got
ERROR_KINDS = {
    "invalid": "a 4xx after admission: the request cannot be served as asked",
    "unavailable": "a 503: no replica could serve it in time",
    "internal": "another 5xx: a backend or engine failure",
    "abort": "the client went away before the end",
}


def error_kind(status: int | None) -> str:
    """The kind of an error answered with HTTP `status` (None: the client went away)."""
    if status is None:
        return "abort"
    if status == 503:
        return "unavailable"
    return "invalid" if 400 <= status < 500 else "internal"


def error_status(exc: BaseException) -> int | None:
    """The HTTP status a request that ended with `exc` got (None: cancelled, the client left)."""
    if isinstance(exc, APIError):
        return exc.status
    return None if isinstance(exc, asyncio.CancelledError | GeneratorExit) else 500


class RequestStatsCollector(Collector):
    """Renders this replica's request metrics plus the other router replicas' (`peers`)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.peers: list[RequestStats] = []

    def collect(self) -> Iterable[Metric]:
        total = self.metrics.request_stats()
        for peer in self.peers:
            total = total + peer
        name = self.metrics.model_name
        for field, (metric, doc, bounds) in HISTOGRAMS.items():
            counts: HistogramCounts = getattr(total, field)
            family = HistogramMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            les = [floatToGoString(b) for b in (*bounds, float("inf"))]
            family.add_metric([name], list(zip(les, counts.buckets, strict=True)), counts.sum)
            yield family
        success = CounterMetricFamily(
            PREFIX + SUCCESS[0], SUCCESS[1], labels=["model_name", "finished_reason"]
        )
        for reason, n in total.success.items():
            success.add_metric([name, reason], n)
        yield success
        rejected = CounterMetricFamily(
            PREFIX + REJECTED[0], REJECTED[1], labels=["model_name", "reason"]
        )
        for reason, n in total.rejected.items():
            rejected.add_metric([name, reason], n)
        yield rejected
        errors = CounterMetricFamily(PREFIX + ERRORS[0], ERRORS[1], labels=["model_name", "kind"])
        for kind, n in total.errors.items():
            errors.add_metric([name, kind], n)
        yield errors


class Metrics:
    """The router's metrics for one served model."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self.engines = EngineStatsCollector(model_name)
        self.requests = RequestStatsCollector(self)
        self.registry.register(self.engines)
        self.registry.register(self.requests)
        # Recorded here, rendered by `self.requests` (summed with the peers): not registered.
        model = ["model_name"]
        self.ttft, self.itl, self.e2e = (
            Histogram(PREFIX + metric, doc, model, buckets=bounds, registry=None)
            for metric, doc, bounds in HISTOGRAMS.values()
        )
        self.success = Counter(
            PREFIX + SUCCESS[0], SUCCESS[1], [*model, "finished_reason"], registry=None
        )
        for histogram in (self.ttft, self.itl, self.e2e):  # exported from the start, at 0
            histogram.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        self.rejected = Counter(
            PREFIX + REJECTED[0], REJECTED[1], [*model, "reason"], registry=None
        )
        for reason in ("queue_full", "pool_full"):
            self.rejected.labels(model_name, reason)
        self.errors = Counter(PREFIX + ERRORS[0], ERRORS[1], [*model, "kind"], registry=None)
        for kind in ERROR_KINDS:
            self.errors.labels(model_name, kind)

    def reject(self, reason: str) -> None:
        """A request was answered 429: "queue_full", too many requests of this router replica
        wait for their first token; "pool_full", a worker pool has its bound of queued calls."""
        self.rejected.labels(self.model_name, reason).inc()

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    @contextmanager
    def outcome(self) -> Iterator[RequestOutcome]:
        """Watch an admitted request: an exception out of the block counts it as failed."""
        outcome = RequestOutcome(self)
        try:
            yield outcome
        except BaseException as e:
            outcome.failed(error_status(e))
            raise

    def request_stats(self) -> RequestStats:
        """This replica's live request metrics."""
        hists = {
            field: _histogram_counts(getattr(self, field), len(bounds) + 1)
            for field, (_, _, bounds) in HISTOGRAMS.items()
        }
        return RequestStats(
            **hists,
            success=_counter_values(self.success, "finished_reason"),
            rejected=_counter_values(self.rejected, "reason"),
            errors=_counter_values(self.errors, "kind"),
        )

    def render(
        self,
        snapshot: Sequence[RoleStats] | None = None,
        peers: Sequence[RequestStats] | None = None,
    ) -> bytes:
        """`peers`: the other router replicas' posted request metrics, added to this one's."""
        if snapshot is not None:
            self.engines.update(snapshot)
        if peers is not None:
            self.requests.peers = list(peers)
        return generate_latest(self.registry)


def _counter_values(counter: Counter, label: str) -> dict[str, float]:
    """A counter's value per value of its `label` (one model_name)."""
    return {
        s.labels[label]: s.value
        for family in counter.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


def _histogram_counts(histogram: Histogram, num_buckets: int) -> HistogramCounts:
    """A histogram's single child (one model_name) as cumulative counts (+Inf last) and sum."""
    buckets: list[float] = []
    total = 0.0
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append(s.value)
            elif s.name.endswith("_sum"):
                total = s.value
    if len(buckets) != num_buckets:  # no child (yet)
        buckets = [0.0] * num_buckets
    return HistogramCounts(buckets=buckets, sum=total)


class RequestTimer:
    """Latency of one choice as the client sees it: first token, gaps between tokens, total."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.num_tokens = 0

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now, name = time.monotonic(), self.metrics.model_name
        gaps = num_tokens
        if self.num_tokens == 0:
            self.metrics.ttft.labels(name).observe(now - self.start)
            gaps -= 1  # the first token's latency is TTFT; any others in its chunk are gaps
        for _ in range(gaps):
            self.metrics.itl.labels(name).observe((now - self.last) / gaps)
        self.num_tokens += num_tokens
        self.last = now

    def finish(self, reason: str | None) -> None:
        name = self.metrics.model_name
        self.metrics.e2e.labels(name).observe(time.monotonic() - self.start)
        self.metrics.success.labels(name, reason or "abort").inc()


class RequestOutcome:
    """How one admitted HTTP request ended: `failed` counts it in `request_errors_total` once,
    however many of its parts (choices, stream, handler) see the failure."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.kind: str | None = None

    def failed(self, status: int | None) -> None:
        """The request failed with HTTP `status` told the client (None: the client went away)."""
        if self.kind is None:
            self.kind = error_kind(status)
            self.metrics.errors.labels(self.metrics.model_name, self.kind).inc()
