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
`PrefixAwarePolicy` (router/routing/policy.py, what the Serve router runs).
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
from workers.kvcache.allocator import PageAllocator
from workers.kvcache.manager import KVManager
from workers.protocol import SamplingParams
from workers.sequence import Sequence as EngineSequence

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
    route_s: float = 0.0


class Sim:
    def __init__(self, args: argparse.Namespace, kv_tokens: int, policy: Policy) -> None:
        self.args, self.policy = args, policy
        pages = kv_tokens // args.page_size
        self.replicas = [
            Replica(f"r{i}", KVManager(PageAllocator(pages + 1), args.page_size, True))
            for i in range(args.replicas)
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self.events: list[tuple[float, int, str, object]] = []
        self.order = 0
        self.result = Result()

    def push(self, t: float, kind: str, payload: object) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, payload))

    def run(self, requests: list[tuple[float, list[int]]]) -> Result:
        for i, (t, prompt) in enumerate(requests):
            self.push(t, "arrive", (f"q{i}", prompt))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, *payload)  # type: ignore[misc]
            else:
                self.finish_step(now, *payload)  # type: ignore[misc]
        self.result.per_replica = [r.computed for r in self.replicas]
        return self.result

    def arrive(self, now: float, rid: str, prompt: list[int]) -> None:
        names = [r.name for r in self.replicas]
        queue_lens = {r.name: len(r.queue) for r in self.replicas}
        t0 = time.perf_counter()
        name = self.policy.rank(names, prompt, queue_lens)[0]
        self.policy.routed(name, rid, prompt)
        self.result.route_s += time.perf_counter() - t0
        seq = EngineSequence(rid, list(prompt), len(prompt), SamplingParams(), None)
        replica = self.by_name[name]
        replica.queue.append(Job(rid, prompt, now, seq))
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
                self.policy.completed(replica.name, job.rid)
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


def policies(args: argparse.Namespace) -> dict[str, Policy]:
    return {
        "round-robin": Blind("round-robin", args.seed),
        "random": Blind("random", args.seed),
        "pow-2 (Serve default)": Blind("pow2", args.seed),
        "prefix-aware": PrefixAwarePolicy(args.page_size),
    }


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def report(name: str, kv_tokens: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """Print the scenario's table; return its rows for the result file."""
    requests = workload(args)
    rows: list[dict[str, object]] = []
    total = sum(len(p) for _, p in requests)
    print(
        f"\n## {name}: {args.replicas} replicas x {kv_tokens} KV tokens; {args.requests} requests "
        f"at {args.rate}/s from {args.tenants} tenants (Zipf {args.zipf}), "
        f"{total / len(requests):.0f} prompt tokens each on average\n"
    )
    print("| policy | cache hit rate | prefill tokens computed | vs round-robin "
          "| TTFT p50 ms | TTFT p99 ms | busiest / idlest replica |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base: Result | None = None
    for label, policy in policies(args).items():
        res = Sim(args, kv_tokens, policy).run(requests)
        base = base or res
        computed = res.prompt_tokens - res.cached_tokens
        ratio = computed / (base.prompt_tokens - base.cached_tokens)
        spread = max(res.per_replica) / max(1, min(res.per_replica))
        print(
            f"| {label} | {res.cached_tokens / res.prompt_tokens:.1%} | {computed:,} "
            f"| {ratio:.2f}x | {1e3 * pct(res.ttfts, 50):.0f} | {1e3 * pct(res.ttfts, 99):.0f} "
            f"| {spread:.2f} |"
        )
        rows.append(
            dict(
                kv_tokens_per_replica=kv_tokens,
                policy=label,
                cache_hit_pct=round(100 * res.cached_tokens / res.prompt_tokens, 1),
                prefill_tokens_computed=computed,
                x_round_robin=round(ratio, 2),
                ttft_p50_ms=round(1e3 * pct(res.ttfts, 50)),
                ttft_p99_ms=round(1e3 * pct(res.ttfts, 99)),
                busiest_x_idlest=round(spread, 2),
            )
        )
        if label == "prefix-aware":
            us = 1e6 * res.route_s / len(requests)
            print(f"\nprefix-aware routing took {us:.0f} us a request (this host, Python)")
    return rows


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
    add_out_argument(ap)
    args = ap.parse_args()
    names = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    rows = [row for name in names for row in report(name, SCENARIOS[name], args)]
    model = (
        f"simulated pool: {args.replicas} prefill replicas, {args.requests} requests at "
        f"{args.rate}/s from {args.tenants} tenants (Zipf {args.zipf})"
    )
    write_result(args.out, "routing", rows, model=model)


if __name__ == "__main__":
    main()
