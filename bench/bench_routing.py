"""Prefill routing policies on a simulated pool, each against round-robin in the same run.

    python -m bench.bench_routing                    # both scenarios: scarce and ample KV
    python -m bench.bench_routing --scenario scarce --replicas 8 --rate 60 [--out DIR]

N prefill replicas, each with the engine's own prefix cache (`KVManager`: radix tree over a
`PageAllocator`), no model. A replica runs engine steps back to back while it has work: a step
prefills up to `--budget` tokens of its queued prompts, first come first served, in chunks, and
takes step_ms + tokens / tok_s (defaults: Llama-3-8B on one H200, from the prefill figures
in docs/benchmarks.md: 8192 tokens in 220 ms). A prompt matches the cache when a step first
admits it and is cached when its last chunk is done; its TTFT is that moment minus its arrival.

Workload: Poisson arrivals of chat requests from tenants with Zipf popularity. Each tenant has
its own system prompt; a request starts a new conversation (system prompt + question) or, with
probability --followup, continues one of its tenant's earlier ones (+ answer + new question).

Policies: round-robin, random, power of two choices on queue length (Ray Serve's default), and
`PrefixAwarePolicy` (router/routing/policy.py, what the Serve router runs) on two indexes: one
guessed from what the router sent (LRU bounded by a replica's KV pages; the index before KV
events), and one fed by the replicas' KV events (their radix caches' stores and evictions,
delivered `--event-delay-ms` after they happen). The oracle is the KV-event policy with no delay:
perfect knowledge of every cache at each decision; "of oracle" is a policy's cached tokens as a
share of the oracle's.

Decision time: `PrefixAwarePolicy.rank` + `routed` + `completed` per request on pools of 64 and
1000 replicas whose caches hold many prefixes, against scoring every replica (what the policy did
before the index walk: linear in the pool).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.results_io import add_out_argument, write_result
from router.routing.policy import PrefixAwarePolicy
from workers.api import KVEventBatch, page_hashes
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import KVEventLog
from workers.kvcache.manager import KVManager
from workers.protocol import SamplingParams
from workers.sequence import Sequence as EngineSequence

clock = time.thread_time  # decision time: CPU time of the routing thread

SCENARIOS = {  # KV tokens per replica: less than the tenants' prompts, or all of them and more
    "scarce": 48_000,
    "ample": 480_000,
}


class Policy(Protocol):
    def rank(
        self, replicas: Sequence[str], prompt: Sequence[int], queue_lens: Mapping[str, int]
    ) -> list[str]: ...
    def routed(self, replica: str, request: str, prompt: Sequence[int]) -> None: ...
    def completed(self, replica: str, request: str) -> None: ...


class OnIndex:
    """`PrefixAwarePolicy` in the simulation: on a guessed index, or on KV events that the
    replicas' caches emit and that reach it `delay_s` later (`observe`)."""

    def __init__(self, args: argparse.Namespace, kv_tokens: int, delay_s: float | None) -> None:
        self.now = 0.0
        guess = None if delay_s is not None else kv_tokens // args.page_size
        self.policy = PrefixAwarePolicy(
            args.page_size, pages_per_replica=guess, clock=lambda: self.now
        )
        self.delay_s = delay_s
        self.inbox: deque[tuple[float, KVEventBatch]] = deque()
        self.members: Sequence[str] = ()

    def observe(self, now: float, batches: list[KVEventBatch]) -> None:
        """The caches' events of this moment; apply those due by now."""
        self.now = now
        if self.delay_s is None:
            return
        self.inbox.extend((now + self.delay_s, batch) for batch in batches)
        while self.inbox and self.inbox[0][0] <= now:
            self.policy.apply(self.inbox.popleft()[1])

    def rank(
        self, replicas: Sequence[str], prompt: Sequence[int], queue_lens: Mapping[str, int]
    ) -> list[str]:
        if self.members is not replicas:
            self.members = replicas
            self.policy.retain(replicas)
        return [str(r) for r in self.policy.rank(prompt)]

    def routed(self, replica: str, request: str, prompt: Sequence[int]) -> None:
        self.policy.routed(replica, request, prompt)

    def completed(self, replica: str, request: str) -> None:
        self.policy.completed(replica, request)


class Blind:
    """Baselines that ignore prompts: round-robin, random, power of two choices."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind, self.rng, self.turn = kind, random.Random(seed), 0

    def rank(
        self, replicas: Sequence[str], prompt: Sequence[int], queue_lens: Mapping[str, int]
    ) -> list[str]:
        if self.kind == "round-robin":
            self.turn += 1
            return [replicas[self.turn % len(replicas)]]
        if self.kind == "random":
            return [self.rng.choice(replicas)]
        two = self.rng.sample(list(replicas), 2)
        return sorted(two, key=lambda r: queue_lens[r])

    def routed(self, replica: str, request: str, prompt: Sequence[int]) -> None:
        pass

    def completed(self, replica: str, request: str) -> None:
        pass


@dataclass
class Job:
    rid: str
    prompt: list[int]
    arrival: float
    seq: EngineSequence
    router: Policy
    admitted: bool = False
    remaining: int = 0


@dataclass
class Replica:
    name: str
    kv: KVManager
    queue: deque[Job] = field(default_factory=deque)
    busy: bool = False
    computed: int = 0


@dataclass
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    per_replica: list[int] = field(default_factory=list)


class Sim:
    def __init__(self, args: argparse.Namespace, kv_tokens: int, routers: list[Policy]) -> None:
        """`routers`: one policy per router replica; requests take turns among them."""
        self.args, self.routers = args, routers
        pages = kv_tokens // args.page_size
        self.replicas = [
            Replica(f"r{i}", KVManager(PageAllocator(pages + 1), args.page_size, True))
            for i in range(args.replicas)
        ]
        for r in self.replicas:
            assert r.kv.radix is not None
            r.kv.radix.events = KVEventLog()
        self.by_name = {r.name: r for r in self.replicas}
        self.names = [r.name for r in self.replicas]
        self.events: list[tuple[float, int, str, object]] = []
        self.order = 0
        self.result = Result()

    def push(self, t: float, kind: str, payload: object) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, payload))

    def run(self, requests: list[tuple[float, list[int]]]) -> Result:
        for i, (t, prompt) in enumerate(requests):
            self.push(t, "arrive", (i, prompt))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, *payload)  # type: ignore[misc]
            else:
                self.finish_step(now, *payload)  # type: ignore[misc]
        self.result.per_replica = [r.computed for r in self.replicas]
        return self.result

    def arrive(self, now: float, i: int, prompt: list[int]) -> None:
        rid, router = f"q{i}", self.routers[i % len(self.routers)]
        queue_lens = {r.name: len(r.queue) for r in self.replicas}
        batches = []
        for r in self.replicas:
            assert r.kv.radix is not None and r.kv.radix.events is not None
            stored, removed, _ = r.kv.radix.events.drain()
            if stored or removed:
                batches.append(KVEventBatch(r.name, "0", stored, removed))
        for other in self.routers:
            if isinstance(other, OnIndex):
                other.observe(now, batches)
        name = router.rank(self.names, prompt, queue_lens)[0]
        router.routed(name, rid, prompt)
        seq = EngineSequence(rid, list(prompt), len(prompt), SamplingParams(), None)
        replica = self.by_name[name]
        replica.queue.append(Job(rid, prompt, now, seq, router))
        if not replica.busy:
            self.start_step(now, replica)

    def start_step(self, now: float, replica: Replica) -> None:
        budget, plan = self.args.budget, list[tuple[Job, int]]()
        for job in replica.queue:
            if budget == 0:
                break
            if not job.admitted:
                replica.kv.match_prefix(job.seq)
                if not replica.kv.reserve(job.seq, len(job.prompt)):
                    replica.kv.release(job.seq, cache=False)
                    break  # no free pages until a running prompt finishes
                job.admitted, job.remaining = True, len(job.prompt) - job.seq.num_computed_tokens
                self.result.prompt_tokens += len(job.prompt)
                self.result.cached_tokens += job.seq.num_computed_tokens
            chunk = min(job.remaining, budget)
            plan.append((job, chunk))
            budget -= chunk
        tokens = self.args.budget - budget
        replica.busy = bool(plan)
        if plan:
            duration = self.args.step_ms / 1e3 + tokens / self.args.tok_s
            self.push(now + duration, "step", (replica, plan))
        else:
            assert not replica.queue, "a prompt larger than a replica's KV pool"

    def finish_step(self, now: float, replica: Replica, plan: list[tuple[Job, int]]) -> None:
        for job, chunk in plan:
            job.remaining -= chunk
            job.seq.num_computed_tokens += chunk
            replica.computed += chunk
            if job.remaining == 0:
                replica.kv.release(job.seq, cache=True)
                replica.queue.remove(job)
                job.router.completed(replica.name, job.rid)
                self.result.ttfts.append(now - job.arrival)
        self.start_step(now, replica)


def workload(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = random.Random(args.seed)
    fresh = iter(range(100, 1 << 30))

    def tokens(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    systems = [tokens(rng.randint(args.system_min, args.system_max)) for _ in range(args.tenants)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    chats: list[list[list[int]]] = [[] for _ in range(args.tenants)]
    out, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.choices(range(args.tenants), weights)[0]
        question = tokens(rng.randint(args.question_min, args.question_max))
        if chats[tenant] and rng.random() < args.followup:
            k = rng.randrange(len(chats[tenant]))
            prompt = chats[tenant][k] + tokens(args.answer_len) + question
            chats[tenant][k] = prompt
        else:
            prompt = systems[tenant] + question
            chats[tenant].append(prompt)
            del chats[tenant][: -args.open_chats]
        out.append((t, prompt))
    return out


ORACLE = "oracle (KV events, no delay)"


def policies(args: argparse.Namespace, kv_tokens: int) -> dict[str, list[Policy]]:
    """Label -> one policy per router replica."""
    n, delay = range(args.routers), args.event_delay_ms / 1e3
    return {
        "round-robin": [Blind("round-robin", args.seed + i) for i in n],
        "random": [Blind("random", args.seed + i) for i in n],
        "pow-2 (Serve default)": [Blind("pow2", args.seed + i) for i in n],
        "prefix-aware, guessed index": [OnIndex(args, kv_tokens, None) for _ in n],
        "prefix-aware, KV events": [OnIndex(args, kv_tokens, delay) for _ in n],
        ORACLE: [OnIndex(args, kv_tokens, 0.0) for _ in n],
    }


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def report(name: str, kv_tokens: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """Print the scenario's table; return its rows for the result file."""
    requests = workload(args)
    rows: list[dict[str, object]] = []
    total = sum(len(p) for _, p in requests)
    print(
        f"\n## {name}: {args.replicas} replicas x {kv_tokens} KV tokens, {args.routers} routers; "
        f"{args.requests} requests "
        f"at {args.rate}/s from {args.tenants} tenants (Zipf {args.zipf}), "
        f"{total / len(requests):.0f} prompt tokens each on average\n"
    )
    print("| policy | cache hit rate | of oracle | prefill tokens computed | vs round-robin "
          "| TTFT p50 ms | TTFT p99 ms | busiest / idlest replica |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = {
        label: Sim(args, kv_tokens, p).run(requests)
        for label, p in policies(args, kv_tokens).items()
    }
    base, oracle = results["round-robin"], results[ORACLE]
    for label, res in results.items():
        computed = res.prompt_tokens - res.cached_tokens
        ratio = computed / (base.prompt_tokens - base.cached_tokens)
        spread = max(res.per_replica) / max(1, min(res.per_replica))
        of_oracle = res.cached_tokens / oracle.cached_tokens
        print(
            f"| {label} | {res.cached_tokens / res.prompt_tokens:.1%} | {of_oracle:.2%} "
            f"| {computed:,} | {ratio:.2f}x | {1e3 * pct(res.ttfts, 50):.0f} "
            f"| {1e3 * pct(res.ttfts, 99):.0f} | {spread:.2f} |"
        )
        rows.append(
            dict(
                kv_tokens_per_replica=kv_tokens,
                policy=label,
                cache_hit_pct=round(100 * res.cached_tokens / res.prompt_tokens, 1),
                hit_tokens_of_oracle_pct=round(100 * of_oracle, 2),
                prefill_tokens_computed=computed,
                x_round_robin=round(ratio, 2),
                ttft_p50_ms=round(1e3 * pct(res.ttfts, 50)),
                ttft_p99_ms=round(1e3 * pct(res.ttfts, 99)),
                busiest_x_idlest=round(spread, 2),
            )
        )
    return rows


def scan_cost(policy: PrefixAwarePolicy, prompt: list[int], names: list[int], r: str) -> float:
    matched = policy.index.depth(names, r)
    return policy.uncached_tokens(len(prompt), matched) + policy.load_weight * policy.loads.get(r)


def decision_time(num_replicas: int, args: argparse.Namespace) -> dict[str, object]:
    """Per-request routing CPU time (this thread's: other processes on the host do not count)
    on a pool of `num_replicas` whose caches hold 8 prefixes of
    64 pages each (from the KV events), with up to 32 requests in flight."""
    rng = random.Random(args.seed)
    ps, tenants = args.page_size, 4 * num_replicas
    systems = [[t] * ps + [rng.randrange(1 << 30) for _ in range(63 * ps)] for t in range(tenants)]
    policy = PrefixAwarePolicy(ps)
    replicas = [f"r{i}" for i in range(num_replicas)]
    policy.retain(replicas)
    for i, r in enumerate(replicas):
        held = [page_hashes(systems[(i * 8 + k) % tenants], ps) for k in range(8)]
        policy.apply(KVEventBatch(r, "0", [n for names in held for n in names]))
    prompts = [systems[rng.randrange(tenants)] + [rng.randrange(1 << 30) for _ in range(200)]
               for _ in range(args.decisions)]  # fmt: skip
    in_flight: deque[tuple[str, str]] = deque()
    walk, scan = [], []
    for i, prompt in enumerate(prompts):
        t0 = clock()
        best = str(policy.rank(prompt)[0])
        policy.routed(best, f"q{i}", prompt)
        walk.append(clock() - t0)
        in_flight.append((best, f"q{i}"))
        if len(in_flight) > 32:
            policy.completed(*in_flight.popleft())
        t0 = clock()
        names = page_hashes(prompt, ps)  # scoring every replica, as before the index walk
        min(replicas, key=lambda r: scan_cost(policy, prompt, names, r))
        scan.append(clock() - t0)
    row: dict[str, object] = dict(
        replicas=num_replicas,
        decision_p50_us=round(1e6 * pct(walk, 50)),
        decision_p99_us=round(1e6 * pct(walk, 99)),
        score_every_replica_p50_us=round(1e6 * pct(scan, 50)),
        score_every_replica_p99_us=round(1e6 * pct(scan, 99)),
    )
    print(" | ".join(["", *map(str, row.values()), ""]).strip())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--system-min", type=int, default=1024)
    ap.add_argument("--system-max", type=int, default=3072)
    ap.add_argument("--question-min", type=int, default=32)
    ap.add_argument("--question-max", type=int, default=384)
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--followup", type=float, default=0.3)
    ap.add_argument("--open-chats", type=int, default=8, help="conversations kept per tenant")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=8192, help="prefill tokens per engine step")
    ap.add_argument("--tok-s", type=float, default=8192 / 0.215, help="prefill tokens/s")
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routers", type=int, default=2, help="router replicas, taking turns")
    ap.add_argument("--event-delay-ms", type=float, default=50.0, help="KV events' delay")
    ap.add_argument("--pool-sizes", type=int, nargs="+", default=[64, 1000])
    ap.add_argument("--decisions", type=int, default=3000, help="requests timed per pool size")
    add_out_argument(ap)
    args = ap.parse_args()
    names = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    rows = [row for name in names for row in report(name, SCENARIOS[name], args)]
    print("\n## decision time (this host, Python), CPU us a request\n")
    print("| replicas | index walk p50 | index walk p99 | every replica scored p50 | p99 |")
    print("| --- | --- | --- | --- | --- |")
    decisions = [decision_time(n, args) for n in args.pool_sizes]
    model = (
        f"simulated pool: {args.replicas} prefill replicas, {args.routers} routers, "
        f"{args.requests} requests at "
        f"{args.rate}/s from {args.tenants} tenants (Zipf {args.zipf})"
    )
    notes = (
        f"{args.routers} router replicas take turns; the replicas' KV events reach the routers "
        f"{args.event_delay_ms:g} ms late. The oracle is the KV-event policy with no delay: "
        "every cache known exactly at each decision; 'hit tokens of oracle' is a policy's cached "
        "tokens as a share of the oracle's. The guessed index learns only from what its own "
        "router sent (the index before KV events). TTFT is the simulated one."
    )
    write_result(
        args.out, "routing", rows, model=model, title="Prefill routing policies", notes=notes
    )
    write_result(
        args.out,
        "routing-decision",
        decisions,
        model="PrefixAwarePolicy on KV events; each replica caches 8 prefixes of 64 pages",
        title="Router decision time (CPU) against the pool's size",
    )


if __name__ == "__main__":
    main()
