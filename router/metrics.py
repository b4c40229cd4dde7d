"""Prometheus metrics named after vLLM's, under `pdserve:` or `vllm:` (`router.metric_names`).

Two sources feed them:
- engine snapshots (`RoleStats`), taken by the /metrics handler from `GenerationBackend.stats()`
  just before rendering: the gauges and the engine's own counters, labelled with `role`
  (vLLM's naming: `engine`). Several engines of one role (a pool's replicas) are summed: the
  counters over every replica that ever posted (a dead one's last values stay, so a total never
  goes down when Serve replaces a replica), the gauges over the live ones only.
  `prompt_tokens_total` counts prompt tokens the engines computed (prefix-cache hits are
  counted by `prefix_cache_hits_total` instead);
- push hooks called while requests run: the request histograms (latencies, token counts, n,
  max_tokens) and `request_success_total` (through `RequestTimer`, one per choice; a failed
  request's choices end as "error", a client gone as "abort"), `request_rejected_total`
  (admission control, `router/admission.py`: requests answered 429, by reason: the router's
  queue or a pool's), `request_errors_total` (an admitted request that ended in an error, once
  per HTTP request, by kind: `ERROR_KINDS`). NIXL hand-off
  counters come with the snapshots: the decode engines count the KV they read.
A scrape reaches one router replica, so the request metrics are rendered as this replica's live
values plus the other router replicas' posted `RequestStats` (`router/metrics_board.py`), dead
ones' last posts included.
Each app gets its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.backend import RoleStats
from router.engine_metrics import EngineStatsCollector
from router.errors import APIError
from router.metric_names import REQUEST_HISTOGRAMS, Naming, request_buckets
from router.request_stats import (
    ERRORS,
    REJECTED,
    SUCCESS,
    HistogramCounts,
    RequestStats,
    RequestStatsCollector,
)
from router.routing.kv_feed import IndexPagesCollector

DEFAULT_MAX_MODEL_LEN = 8192  # the token-count buckets' top when the app does not say
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


class Metrics:
    """The router's metrics for one served model. `naming`: pdserve's or vLLM's names;
    `max_model_len` tops the token-count buckets; `cache_info`: the static labels of
    `cache_config_info` (block_size, cache_dtype, ...)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 naming: Naming | None = None, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 cache_info: Mapping[str, str] | None = None) -> None:
        self.model_name = model_name
        self.naming = naming = naming or Naming()
        self.registry = registry or CollectorRegistry()
        self.labels = naming.request_labels(model_name)
        self.buckets = request_buckets(max_model_len)
        self.engines = EngineStatsCollector(model_name, naming, cache_info)
        self.requests = RequestStatsCollector(self.request_stats, naming, model_name,
                                              self.buckets)
        self.registry.register(self.engines)
        self.registry.register(self.requests)
        self.registry.register(IndexPagesCollector(model_name, naming))
        # Recorded here, rendered by `self.requests` (summed with the peers): not registered.
        names = list(self.labels)
        self.histograms = {
            key: Histogram(key, doc, names, buckets=self.buckets[key], registry=None)
            for key, (_, doc, _) in REQUEST_HISTOGRAMS.items()
        }
        for histogram in self.histograms.values():  # exported from the start, at 0
            histogram.labels(**self.labels)
        self.success = Counter(SUCCESS[0], SUCCESS[1], [*names, "finished_reason"],
                               registry=None)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(**self.labels, finished_reason=reason)
        self.rejected = Counter(REJECTED[0], REJECTED[1], [*names, "reason"], registry=None)
        for reason in ("queue_full", "pool_full"):
            self.rejected.labels(**self.labels, reason=reason)
        self.errors = Counter(ERRORS[0], ERRORS[1], [*names, "kind"], registry=None)
        for kind in ERROR_KINDS:
            self.errors.labels(**self.labels, kind=kind)

    def observe(self, key: str, value: float) -> None:
        """One observation of the request histogram `key` (of REQUEST_HISTOGRAMS)."""
        self.histograms[key].labels(**self.labels).observe(value)

    def reject(self, reason: str) -> None:
        """A request was answered 429: "queue_full", too many requests of this router replica
        wait for their first token; "pool_full", a worker pool has its bound of queued calls."""
        self.rejected.labels(**self.labels, reason=reason).inc()

    def request_timer(self, prompt_tokens: int = 0, n: int = 1, max_tokens: int = 0,
                      arrival: float | None = None) -> RequestTimer:
        """The timer of one choice, handed to the pools now; `arrival`: when its HTTP request
        came (`time.monotonic()`), for the queue time; the request's prompt length, n and
        max_tokens are observed when it finishes."""
        return RequestTimer(self, prompt_tokens, n, max_tokens, arrival)

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
            key: _histogram_counts(histogram, len(self.buckets[key]) + 1)
            for key, histogram in self.histograms.items()
        }
        return RequestStats(
            histograms=hists,
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
    """One choice as the client sees it: first token, gaps between tokens, total, and vLLM's
    phases from the router's view: queue (arrival to the hand-off to the pools), prefill
    (hand-off to first token), decode (first to last token), inference (hand-off to the end)."""

    def __init__(self, metrics: Metrics, prompt_tokens: int = 0, n: int = 1,
                 max_tokens: int = 0, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.arrival = self.start if arrival is None else arrival
        self.first: float | None = None
        self.num_tokens = 0
        self.request = {"prompt_tokens": prompt_tokens, "n": n, "max_tokens": max_tokens}

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        gaps = num_tokens
        if self.first is None:
            self.first = now
            self.metrics.observe("ttft", now - self.arrival)
            gaps -= 1  # the first token's latency is TTFT; any others in its chunk are gaps
        for _ in range(gaps):
            self.metrics.observe("itl", (now - self.last) / gaps)
        self.num_tokens += num_tokens
        self.last = now

    def finish(self, reason: str | None) -> None:
        now, observe = time.monotonic(), self.metrics.observe
        observe("e2e", now - self.arrival)
        observe("queue", self.start - self.arrival)
        observe("inference", now - self.start)
        if self.first is not None:
            observe("prefill", self.first - self.start)
            observe("decode", now - self.first)
            if self.num_tokens > 1:
                observe("tpot", (now - self.first) / (self.num_tokens - 1))
        observe("generation_tokens", self.num_tokens)
        for key, value in self.request.items():
            observe(key, value)
        self.metrics.success.labels(**self.metrics.labels, finished_reason=reason or "abort").inc()


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
            self.metrics.errors.labels(**self.metrics.labels, kind=self.kind).inc()
