"""Soak: minutes of mixed load with client aborts and replica kills, then what was left behind.

    python -m bench.soak [--config configs/local.yaml] [--minutes 5] [--kill-every-s 60]
        [--concurrency 6] [--set prefill.num_replicas=2 ...] [--out DIR]

Serves the config's pdserve application in this process's Ray (a local cluster), sends a mix of
requests (completions and chat, streamed or not, `n` = 1 or 2, a prompt list now and then), has
the client walk away from some streams mid-way, and kills a random prefill or decode replica
every `--kill-every-s` seconds (Serve replaces it). Afterwards, once the load has drained, it
reports what a long run would accumulate:
- leaked pages: pages pinned, or used outside the prefix cache, on any replica (goal 0);
- RSS of the replicas and the router before and after (replicas alive throughout);
- every request's outcome by kind (HTTP status, error event in a stream, our own aborts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import ray
from ray import serve

from bench.results_io import add_out_argument, write_result
from cluster.app import build_app
from cluster.cli import apply_overrides, pdserve_apps, serve_configs
from cluster.config import AppConfig
from workers.api import read_pool
from workers.env import python_path
from workers.parallel.rendezvous import free_port

REPO = str(Path(__file__).resolve().parents[1])
APP = "pdserve-soak"
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Write a haiku about the sea.",
]
DRAIN_S = 120.0  # the load's last requests and the leases of aborted ones end within this


def request_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """One request of the mix: (path, JSON body)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(4, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.6,
        "n": 2 if rng.random() < 0.2 else 1,
    }
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return "/v1/chat/completions", body
    body["prompt"] = rng.sample(PROMPTS, 2) if rng.random() < 0.1 else rng.choice(PROMPTS)
    return "/v1/completions", body


async def send(client: httpx.AsyncClient, rng: random.Random, model: str) -> str:
    """Send one request of the mix; its outcome's kind."""
    path, body = request_body(rng, model)
    abort_after = rng.randint(1, 4) if body["stream"] and rng.random() < 0.15 else None
    try:
        if not body["stream"]:
            reply = await client.post(path, json=body)
            return f"http {reply.status_code}"
        async with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                return f"http {reply.status_code}"
            chunks = 0
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    return "stream error " + json.loads(line[6:])["error"].get("type", "?")
                chunks += line.startswith("data: {")
                if abort_after is not None and chunks >= abort_after:
                    return "aborted by the client"
            return "http 200"
    except httpx.HTTPError as e:
        return f"transport {type(e).__name__}"


async def load(base: str, model: str, seconds: float, concurrency: int, seed: int) -> Counter:
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120.0)) as client:

        async def user(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                outcomes[await send(client, rng, model)] += 1

        await asyncio.gather(*(user(i) for i in range(concurrency)))
    return outcomes


def replicas(deployments: tuple[str, ...] = ("prefill", "decode", "router")) -> dict[str, int]:
    """The app's live replica processes of `deployments` on this host: a name -> its pid (Ray
    titles a replica's process `ray::ServeReplica:<app>:<deployment>`)."""
    titles = tuple(f"ray::ServeReplica:{APP}:{d}" for d in deployments)
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith(titles):
            out[f"{title.split()[0]}@{proc.info['pid']}"] = proc.info["pid"]
    return out


def replica_actors(deployments: tuple[str, ...]) -> list[str]:
    """The names of the app's replica actors of `deployments` (in the "serve" namespace)."""
    prefixes = tuple(f"SERVE_REPLICA::{APP}#{d}#" for d in deployments)
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefixes)]  # fmt: skip


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def kill_replicas(every_s: float, seconds: float, seed: int) -> list[str]:
    """Kill a random prefill or decode replica every `every_s` seconds; the names killed."""
    rng, killed = random.Random(seed), []
    end = time.monotonic() + seconds
    while time.monotonic() + every_s < end:
        await asyncio.sleep(every_s)
        pools = replica_actors(("prefill", "decode"))
        if pools:
            name = rng.choice(pools)
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            killed.append(name)
            print(f"killed {name}", flush=True)
    return killed


def leaked_pages() -> dict[str, int]:
    """Pinned pages, and pages used outside the prefix cache, over every live replica of both
    pools; running and waiting requests (all 0 once the load has drained)."""
    posted = read_pool(APP, "prefill") + read_pool(APP, "decode")
    stats = [p.stats for p in posted if p.live]  # a killed replica's last post is not its pages
    return {
        "pinned": sum(s.kv_pages_pinned for s in stats),
        "used_outside_cache": sum(s.kv_pages_used - s.kv_pages_cached for s in stats),
        "running": sum(s.num_running + s.num_waiting for s in stats),
        "replicas": len(stats),
    }


def drained(start: float) -> dict[str, int]:
    """Leaked pages once every replica reports an idle engine, or at DRAIN_S."""
    while True:
        left = leaked_pages()
        idle = left["pinned"] == left["used_outside_cache"] == left["running"] == 0
        if idle or time.monotonic() - start > DRAIN_S:
            return left
        time.sleep(1.0)


def app_config(path: Path, assignments: list[str]) -> AppConfig:
    apps = [a for cfg in serve_configs(path) for a in pdserve_apps(cfg)]
    return AppConfig.model_validate(apply_overrides(apps[0].get("args") or {}, assignments))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=Path(REPO) / "configs" / "local.yaml")
    ap.add_argument("--set", dest="assignments", action="append", default=[])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs: the replicas' bundles")
    add_out_argument(ap)
    args = ap.parse_args()
    cfg = app_config(args.config, args.assignments)
    ray.init(
        num_cpus=args.ray_cpus, include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path(REPO)}},
    )  # fmt: skip
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(cfg), name=APP, route_prefix="/")
        base, seconds = f"http://127.0.0.1:{port}", args.minutes * 60
        asyncio.run(load(base, cfg.model_name, 10, 2, args.seed + 1))  # warm up
        before = {n: rss_mb(pid) for n, pid in replicas().items()}

        async def soak() -> tuple[Counter, list[str]]:
            return await asyncio.gather(
                load(base, cfg.model_name, seconds, args.concurrency, args.seed),
                kill_replicas(args.kill_every_s, seconds, args.seed),
            )

        outcomes, killed = asyncio.run(soak())
        left = drained(time.monotonic())
        after = {n: rss_mb(pid) for n, pid in replicas().items()}
        growth = {
            n: round(now - mb, 1)
            for n, mb in before.items()
            if mb is not None and (now := after.get(n)) is not None
        }
        probe = asyncio.run(load(base, cfg.model_name, 5, 1, args.seed + 2))
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = [dict(outcome=k, requests=v) for k, v in sorted(outcomes.items())]
    print(json.dumps(dict(outcomes=dict(outcomes), killed=killed, leaked=left,
                          rss_growth_mb=growth, after=dict(probe)), indent=1))  # fmt: skip
    write_result(
        args.out, "soak", rows, model=f"{cfg.model_name}, {cfg.mode}",
        notes=f"{args.minutes} minutes, {len(killed)} replicas killed; left after the drain: "
        f"{left}; RSS growth of the replicas alive throughout (MB): {growth}; "
        f"requests after the soak: {dict(probe)}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
