"""Per-pool SLA autoscaling under a rising and falling load, simulated: the policy against fixed
provisioning at the peak.

A disaggregated pool pair serves a sine of request rates (`--min-rate` to `--max-rate` req/s,
period `--period-s`, Poisson arrivals) of long prompts. The replicas are simulated with service
times calibrated on the H200 figures in bench/results (Llama-3-8B shapes, one GPU a replica):
- prefill: a replica computes prompt tokens first come first served at `PREFILL_TOKENS_PER_S`
  (8192-token chunks in 217 ms: bench/results/prefill_h200_2026-11-29.json);
- decode: every running sequence gets a token per step of `DECODE_STEP_MS` + batch x
  (`DECODE_SEQ_MS` + `DECODE_CTX_MS` x context) ms (fitted to the batch 1..256, context
  1024..4096 rows of bench/results/decode_h200_2026-12-01.json, within 5%), at most
  `MAX_NUM_SEQS` sequences and `KV_TOKENS` of KV a replica; sequences beyond wait, stalled.
Requests go to the prefill replica with the fewest queued tokens and the decode replica with the
fewest running sequences (as pdserve's routers); a new replica serves `--startup-s` after it is
asked for; one asked to leave takes no new request and goes when it is empty.

Each replica has the `LoadMeter` a pdserve replica has, on the simulated clock; every
`RECORD_S` its `snapshot()` is recorded, and every second the pool's policy is called as Serve
calls it: `SlaPolicy` wrapped by Serve's own `_apply_autoscaling_config`, on an
`AutoscalingContext` whose metrics are each replica's mean over the look-back window. The
targets, bounds and delays are the pools' `autoscaling` in `--config` (configs/llama.yaml).
The fixed runs provision each pool at the most replicas the policy used, and at one fewer.
Reported: the share of requests within the TTFT and the TPOT target (and both), TTFT/TPOT
p50/p99, replica-seconds per pool, and scaling reversals (a change of direction of a pool's
target replica count; a sine needs at least one per peak and per trough).

    python -m bench.autoscale_sim [--config configs/llama.yaml] [--duration-s 1200] [--out DIR]
"""

from __future__ import annotations

import argparse
import heapq
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from bench.results_io import add_out_argument, write_result
from cluster.app import serve_autoscaling_config
from cluster.config import AppConfig, PoolConfig
from workers.serve.load_meter import LoadMeter

PREFILL_TOKENS_PER_S = 8192 / 0.2171
DECODE_STEP_MS, DECODE_SEQ_MS, DECODE_CTX_MS = 4.0, 0.0205, 3.0e-5
MAX_NUM_SEQS = 256
KV_TOKENS = 760_000  # ~100 GB of an H200 at 128 KiB of bf16 KV a token (Llama-3-8B)
DT = 0.01  # simulation step, seconds
RECORD_S = 2.0  # Serve records a replica's autoscaling stats every 2 s (push 10 s x 0.2)


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    ttft: float = math.nan
    tpot: float = math.nan
    decode_from: float = 0.0


@dataclass
class Replica:
    ready_at: float
    meter: LoadMeter
    leaving: bool = False
    records: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)

    def record(self, now: float, window_s: float, kv: float, seats: float) -> None:
        self.records.append((now, self.meter.snapshot(kv_usage=kv, seat_usage=seats)))
        while self.records and self.records[0][0] < now - window_s:
            self.records.popleft()

    def window_means(self) -> dict[str, float]:
        sums: dict[str, list[float]] = {}
        for _, snap in self.records:
            for k, v in snap.items():
                sums.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in sums.items()}


@dataclass
class PrefillReplica(Replica):
    queue: deque[list[Any]] = field(default_factory=deque)  # [request, tokens left]
    queued: int = 0

    def busy(self) -> bool:
        return bool(self.queue)

    def step(self, now: float) -> list[Request]:
        budget, done = PREFILL_TOKENS_PER_S * DT, []
        while self.queue and budget > 0:
            entry = self.queue[0]
            used = min(budget, entry[1])
            entry[1] -= used
            budget -= used
            if entry[1] <= 0:
                self.queue.popleft()
                req = entry[0]
                t = now + DT - budget / PREFILL_TOKENS_PER_S
                req.ttft = t - req.arrival
                self.queued -= req.prompt
                self.meter.prefilled(req.prompt, req.ttft)
                req.decode_from = t
                done.append(req)
        return done

    def usage(self) -> tuple[float, float]:
        return 0.0, 0.0


@dataclass
class DecodeReplica(Replica):
    progress: float = 0.0  # tokens each running sequence has received since this replica began
    running: list[tuple[float, int, Request]] = field(default_factory=list)  # heap by end
    waiting: deque[Request] = field(default_factory=deque)
    kv_used: float = 0.0  # prompt tokens + tokens generated, of the running sequences
    joined_sum: float = 0.0  # sum of `progress` at each running sequence's start

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def admit(self) -> None:
        while self.waiting and len(self.running) < MAX_NUM_SEQS:
            req = self.waiting[0]
            if self.kv_tokens() + req.prompt + req.output > KV_TOKENS:
                break
            self.waiting.popleft()
            heapq.heappush(self.running, (self.progress + req.output - 1, id(req), req))
            self.kv_used += req.prompt
            self.joined_sum += self.progress

    def kv_tokens(self) -> float:
        return self.kv_used + len(self.running) * self.progress - self.joined_sum

    def step(self, now: float) -> list[Request]:
        self.admit()
        b = len(self.running)
        stalled = len(self.waiting)
        if b:
            context = self.kv_tokens() / b
            step_s = (DECODE_STEP_MS + b * (DECODE_SEQ_MS + DECODE_CTX_MS * context)) / 1e3
            gained = DT / step_s
            self.progress += gained
            self.meter.decoded(b * gained, b * DT, alone=b == 1)
        if stalled:
            self.meter.decoded(0, stalled * DT)
        done = []
        while self.running and self.running[0][0] <= self.progress:
            end, _, req = heapq.heappop(self.running)
            self.kv_used -= req.prompt
            self.joined_sum -= end - req.output + 1
            req.tpot = (now + DT - req.decode_from) / max(1, req.output - 1)
            done.append(req)
        return done

    def usage(self) -> tuple[float, float]:
        return self.kv_tokens() / KV_TOKENS, len(self.running) / MAX_NUM_SEQS


class Pool:
    """One pool's replicas and its autoscaling, as Serve runs it (`config` None: fixed)."""

    def __init__(self, name: str, cfg: PoolConfig, fixed: int | None, startup_s: float) -> None:
        self.name, self.startup_s, self.clock = name, startup_s, 0.0
        self.kind = PrefillReplica if name == "prefill" else DecodeReplica
        a = cfg.autoscaling
        self.serve_config = None if fixed or a is None else ServeAutoscalingConfig(
            **serve_autoscaling_config(a))  # fmt: skip
        if self.serve_config is not None:
            self.policy = _apply_autoscaling_config(
                _resolve_policy_callable(self.serve_config.policy))  # fmt: skip
        self.window_s = a.look_back_period_s if a is not None else 30.0
        count = fixed or (a.initial_replicas or a.min_replicas if a else cfg.num_replicas)
        self.replicas: list[Any] = [self.kind(0.0, self._meter()) for _ in range(count)]
        self.target, self.state = count, {}
        self.history: list[int] = [count]
        self.replica_s = 0.0

    def _meter(self) -> LoadMeter:
        return LoadMeter(clock=lambda: self.clock)

    def serving(self) -> list[Any]:
        return [r for r in self.replicas if r.ready_at <= self.clock and not r.leaving]

    def step(self, now: float, counted: bool) -> list[Request]:
        self.clock = now
        self.replica_s += len(self.replicas) * DT if counted else 0.0
        done = [req for r in self.replicas if r.ready_at <= now for req in r.step(now)]
        self.replicas = [r for r in self.replicas if not (r.leaving and not r.busy())]
        return done

    def record(self, now: float) -> None:
        for r in self.serving():
            r.record(now, self.window_s, *r.usage())

    def decide(self, now: float) -> None:
        if self.serve_config is None:
            return
        serving = self.serving()
        metrics: dict[str, dict[int, float]] = {}
        for i, r in enumerate(serving):
            for k, v in r.window_means().items():
                metrics.setdefault(k, {})[i] = v
        ctx = AutoscalingContext(
            deployment_id=DeploymentID(name=self.name, app_name="sim"),
            deployment_name=self.name, app_name="sim", current_num_replicas=len(serving),
            target_num_replicas=self.target, running_replicas=[], total_num_requests=0.0,
            total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
            capacity_adjusted_min_replicas=self.serve_config.min_replicas,
            capacity_adjusted_max_replicas=self.serve_config.max_replicas,
            policy_state=self.state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=self.serve_config,
        )  # fmt: skip
        target, self.state = self.policy(ctx)
        if target != self.target:
            self.history.append(target)
        self.target = target
        present = [r for r in self.replicas if not r.leaving]
        for _ in range(target - len(present)):
            self.replicas.append(self.kind(now + self.startup_s, self._meter()))
        surplus = len(present) - target
        for r in sorted(present, key=lambda r: (r.ready_at <= now, r.busy()))[: max(0, surplus)]:
            r.leaving = True  # starting ones first, then idle ones

    def reversals(self) -> int:
        steps = [b - a for a, b in zip(self.history, self.history[1:])]
        return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


def arrivals(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    """Poisson arrivals of a rate from min to max and back each period, starting at the min."""
    out, t = [], 0.0
    peak = args.max_rate
    while True:
        t += rng.expovariate(peak)  # thinning: keep each with rate(t) / peak
        if t >= args.duration_s:
            return out
        swing = (1 - math.cos(2 * math.pi * t / args.period_s)) / 2
        if rng.random() < (args.min_rate + (args.max_rate - args.min_rate) * swing) / peak:
            prompt = rng.randint(*args.prompt_tokens)
            out.append(Request(t, prompt, rng.randint(*args.output_tokens)))


def simulate(
    cfg: AppConfig,
    requests: list[Request],
    args: argparse.Namespace,
    fixed: dict[str, int] | None = None,
) -> tuple[list[Request], dict[str, Pool]]:
    fixed = fixed or {}
    pools = {name: Pool(name, getattr(cfg, name), fixed.get(name), args.startup_s)
             for name in ("prefill", "decode")}  # fmt: skip
    prefill, decode = pools["prefill"], pools["decode"]
    pending = deque(Request(r.arrival, r.prompt, r.output) for r in requests)
    finished: list[Request] = []
    ticks = int(args.duration_s / DT)
    for tick in range(ticks + int(120 / DT)):  # and two minutes to drain
        now = tick * DT
        while pending and pending[0].arrival <= now:
            req = pending.popleft()
            replica = min(prefill.serving(), key=lambda r: r.queued)
            replica.queue.append([req, req.prompt])
            replica.queued += req.prompt
            replica.meter.admitted(req.prompt)
        counted = now < args.duration_s  # replica-seconds of the load, not of the drain
        for req in prefill.step(now, counted):
            min(decode.serving(), key=lambda r: r.load()).waiting.append(req)
        finished += decode.step(now, counted)
        if tick % int(RECORD_S / DT) == 0:
            prefill.record(now)
            decode.record(now)
        if tick % int(1 / DT) == 0 and counted:
            prefill.decide(now)
            decode.decide(now)
    return finished, pools


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def summary(
    label: str, cfg: AppConfig, requests: list[Request], done: list[Request], pools: dict[str, Pool]
) -> dict[str, Any]:
    a_p, a_d = cfg.prefill.autoscaling, cfg.decode.autoscaling
    ttft_ms = a_p.ttft_ms if a_p and a_p.ttft_ms else math.inf
    tpot_ms = a_d.tpot_ms if a_d and a_d.tpot_ms else math.inf
    ttft_ok = sum(1 for r in done if r.ttft * 1e3 <= ttft_ms)
    tpot_ok = sum(1 for r in done if r.tpot * 1e3 <= tpot_ms)
    both = sum(1 for r in done if r.ttft * 1e3 <= ttft_ms and r.tpot * 1e3 <= tpot_ms)
    n = len(requests)  # unfinished requests count as missing both
    p, d = pools["prefill"], pools["decode"]
    return {
        "provisioning": label,
        "requests": n,
        "ttft_met_share": round(ttft_ok / n, 4),
        "tpot_met_share": round(tpot_ok / n, 4),
        "both_met_share": round(both / n, 4),
        "p50_ttft_ms": round(1e3 * percentile([r.ttft for r in done], 0.5), 1),
        "p99_ttft_ms": round(1e3 * percentile([r.ttft for r in done], 0.99), 1),
        "p50_tpot_ms": round(1e3 * percentile([r.tpot for r in done], 0.5), 2),
        "p99_tpot_ms": round(1e3 * percentile([r.tpot for r in done], 0.99), 2),
        "prefill_replica_s": round(p.replica_s),
        "decode_replica_s": round(d.replica_s),
        "replica_s": round(p.replica_s + d.replica_s),
        "prefill_replicas_max": max(p.history),
        "decode_replicas_max": max(d.history),
        "prefill_reversals": p.reversals(),
        "decode_reversals": d.reversals(),
    }


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/llama.yaml"))
    ap.add_argument("--duration-s", type=float, default=1200.0)
    ap.add_argument("--period-s", type=float, default=600.0)
    ap.add_argument("--min-rate", type=float, default=1.0)
    ap.add_argument("--max-rate", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=span, default=(2048, 8192), help="LOW:HIGH, uniform")
    ap.add_argument("--output-tokens", type=span, default=(256, 768), help="LOW:HIGH, uniform")
    ap.add_argument("--startup-s", type=float, default=30.0, help="a new replica's start time")
    ap.add_argument("--seed", type=int, default=0)
    add_out_argument(ap)
    args = ap.parse_args()
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # one line per policy built
    doc = yaml.safe_load(args.config.read_text())
    cfg = AppConfig.model_validate(doc["applications"][0]["args"])
    requests = arrivals(args, random.Random(args.seed))
    done, pools = simulate(cfg, requests, args)
    rows = [summary("sla-autoscaled", cfg, requests, done, pools)]
    peak = {name: max(pool.history) for name, pool in pools.items()}
    done, pools = simulate(cfg, requests, args, fixed=peak)
    rows.append(summary("fixed-at-peak", cfg, requests, done, pools))
    less = {name: max(1, n - 1) for name, n in peak.items()}
    done, pools = simulate(cfg, requests, args, fixed=less)
    rows.append(summary("fixed-one-below-peak", cfg, requests, done, pools))
    for row in rows:
        row["replica_s_x_fixed"] = round(row["replica_s"] / rows[1]["replica_s"], 3)
        print(row)
    print(f"replica-seconds: {rows[0]['replica_s_x_fixed']:.2f} of fixed provisioning at the peak")
    a_p, a_d = cfg.prefill.autoscaling, cfg.decode.autoscaling
    targets = f"TTFT {a_p and a_p.ttft_ms} ms (prefill), TPOT {a_d and a_d.tpot_ms} ms (decode)"
    write_result(
        args.out,
        "autoscale-sim",
        rows,
        title="Per-pool SLA autoscaling against fixed provisioning at the peak, simulated",
        model="Simulated Llama-3-8B replicas, one H200 each (service times from the prefill and "
        "decode results on H200); disaggregated; policy and targets from "
        f"{args.config.as_posix()}",
        notes=f"Targets: {targets}. A sine of {args.min_rate:g} to {args.max_rate:g} req/s, period "
        f"{args.period_s:g} s, over {args.duration_s:g} s (Poisson arrivals, seed {args.seed}); "
        f"prompts of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, "
        f"{args.output_tokens[0]}-{args.output_tokens[1]} out; a new replica serves "
        f"{args.startup_s:g} s after it is asked for. Fixed: each pool at the most replicas the "
        "policy used, from the start (and one replica fewer a pool, to show the peak needs "
        "them). Reversals: changes of direction of a pool's target "
        "(the sine's peaks and troughs need at least one each).",
    )


if __name__ == "__main__":
    main()
