"""KV-event channels on a local Ray cluster: what a replica's publish and a router's read cost.

    python -m bench.bench_kv_channel [--batches 500] [--out DIR]

A replica publishes batches of `--pages` page names; a router reads what is new. Two channels:
- hub: a named Ray actor (`workers/serve/kv_event_hub.py`): publish = one actor call; read = one
  call answering every batch since the reader's cursor;
- internal KV: Ray's internal KV (what the stats board uses): publish = one put under a new key;
  read = a list of the replica's keys, then one get per new key.
Serve's routing stats (`record_routing_stats`) are not timed: each poll keeps only a replica's
latest value, so a batch between two polls would be lost, and a change waits a whole
`request_routing_stats_period_s` for the next poll.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray

from bench.results_io import add_out_argument, write_result
from workers.kvcache.kv_events import KVEventBatch
from workers.ray_kv import ray_internal_kv
from workers.serve.kv_event_hub import KVEventHub, KVEventRead


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(channel: str, op: str, times: list[float]) -> dict[str, object]:
    q = statistics.quantiles(times, n=100)
    return dict(channel=channel, op=op, p50_us=round(1e6 * q[49]), p99_us=round(1e6 * q[98]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--pages", type=int, default=64, help="page names a batch carries")
    ap.add_argument("--per-read", type=int, default=4, help="batches new at each read")
    add_out_argument(ap)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    batch = KVEventBatch("replica-0", "i", list(range(args.pages)), [])
    hub: Any = ray.remote(KVEventHub).options(num_cpus=0).remote()
    ray.get(hub.publish.remote("prefill", batch))
    rows = [
        row("hub", "publish", timed(lambda: ray.get(hub.publish.remote("p", batch)), args.batches))
    ]
    cursor: list[KVEventRead] = [ray.get(hub.read.remote("", 0))]

    def hub_read() -> None:
        for _ in range(args.per_read):
            hub.publish.remote("p", batch)
        ray.get(hub.publish.remote("p", batch))
        start = time.perf_counter()
        read = ray.get(hub.read.remote(cursor[0].epoch, cursor[0].cursor))
        reads.append(time.perf_counter() - start)
        cursor[0] = read

    reads: list[float] = []
    timed(hub_read, args.batches // args.per_read)
    rows.append(row("hub", f"read {args.per_read + 1} new batches", reads))

    kv = ray_internal_kv()
    assert kv is not None
    body, seq = pickle.dumps(batch), [0]

    def put() -> None:
        seq[0] += 1
        kv._internal_kv_put(f"kv-events/replica-0/{seq[0]:012d}", body, namespace="bench")

    rows.append(row("internal KV", "publish", timed(put, args.batches)))
    seen: set[bytes] = set()

    def kv_read() -> None:
        for _ in range(args.per_read + 1):
            put()
        start = time.perf_counter()
        keys = kv._internal_kv_list("kv-events/replica-0/", namespace="bench")
        for key in keys:
            if key not in seen:
                pickle.loads(kv._internal_kv_get(key, namespace="bench"))
                seen.add(key)
        reads.append(time.perf_counter() - start)

    reads = []
    timed(kv_read, args.batches // args.per_read)
    rows.append(row("internal KV", f"read {args.per_read + 1} new batches", reads))
    print("| channel | operation | p50 us | p99 us |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['channel']} | {r['op']} | {r['p50_us']} | {r['p99_us']} |")
    write_result(
        args.out,
        "kv-channel",
        rows,
        model=f"batches of {args.pages} page names",
        title="KV-event channels: a Ray actor hub against Ray's internal KV",
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
