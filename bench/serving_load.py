"""The load side of `bench_serving.py`: streamed OpenAI completions sent as `vllm bench serve`
sends them, timed chunk by chunk, and the figures it reports (TTFT, TPOT, ITL, E2E, goodput, and
the steady completion rate while requests arrive)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float = 0.0  # time.perf_counter() when sent ...
    done_at: float = 0.0  # ... and when its last chunk came (0: failed)


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = last = result.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                if event.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.done_at = time.perf_counter()
    result.e2e = result.done_at - start
    result.ok = result.output_tokens == max_tokens
    if not result.ok:
        result.error = f"{result.output_tokens} of {max_tokens} tokens"
    return result


Turn = tuple[list[int], int]  # a prompt and its output length
Conversation = list[Turn]  # turns sent one after another, each prompt extending the last


async def run_workload(
    url: str, model: str, conversations: list[Conversation], rate: float,
    max_concurrency: int | None, seed: int,
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Start every conversation (Poisson arrivals at `rate` a second; inf: all at once), each
    sending its next turn once the last one ended. Returns every turn's result and the seconds
    from the first send to the last reply."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(conversations))
    timeout = httpx.Timeout(1800.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def converse(turns: Conversation) -> list[RequestResult]:
            results = []
            for prompt, max_tokens in turns:
                async with limit:
                    results.append(await stream_one(client, url, model, prompt, max_tokens))
            return results

        start = time.perf_counter()
        tasks = []
        for turns in conversations:
            tasks.append(asyncio.create_task(converse(turns)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return [r for turn_results in results for r in turn_results], time.perf_counter() - start


def make_conversations(args: argparse.Namespace, seed: int, count: int) -> list[Conversation]:
    """`count` conversations of `turns` turns. A first prompt is one of `num_prefixes` shared
    prefixes of `prefix_len` tokens plus input_len (± range_ratio) random token ids; each later
    turn's prompt is the one before plus as many new ids (the server's answers are not known
    in advance, so they are not part of it)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    def around(n: int) -> int:
        return max(1, round(n * rng.uniform(1 - args.range_ratio, 1 + args.range_ratio)))

    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    conversations = []
    for _ in range(count):
        prompt, turns = rng.choice(prefixes), []
        for _ in range(args.turns):
            prompt = prompt + ids(around(args.input_len))
            turns.append((prompt, around(args.output_len)))
        conversations.append(turns)
    return conversations


def tpot(r: RequestResult) -> float:
    """Seconds per output token after the first (vLLM's TPOT); 0 for one token."""
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def summarize(
    results: list[RequestResult], duration: float, slo_ms: dict[str, float]
) -> dict[str, float]:
    """Throughput and latency figures; with `slo_ms` (ttft, tpot, e2e) also the goodput:
    completed requests a second that met every one of them (DistServe's definition)."""
    done = [r for r in results if r.ok]
    out = dict(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration,
        request_per_s=len(done) / duration,
        output_tok_per_s=sum(r.output_tokens for r in done) / duration,
        total_tok_per_s=sum(r.output_tokens + r.prompt_tokens for r in done) / duration,
    )
    series = {
        "ttft_ms": [r.ttft for r in done],
        "tpot_ms": [tpot(r) for r in done if r.output_tokens > 1],
        "itl_ms": [gap for r in done for gap in r.itl],
        "e2e_ms": [r.e2e for r in done],
    }
    for name, values in series.items():
        ms = 1e3 * np.asarray(values or [math.nan])
        out[f"mean_{name}"] = float(ms.mean())
        out[f"median_{name}"] = float(np.median(ms))
        out[f"p99_{name}"] = float(np.percentile(ms, 99))
    if slo_ms:
        seconds = {"ttft": lambda r: r.ttft, "tpot": tpot, "e2e": lambda r: r.e2e}
        good = [r for r in done if all(seconds[k](r) * 1e3 <= v for k, v in slo_ms.items())]
        out["goodput_req_per_s"] = len(good) / duration
        out["slo_met_fraction"] = len(good) / max(1, len(results))
    return out


def steady_rate(results: list[RequestResult]) -> dict[str, float]:
    """`arrival_window_s`: first send to last send. `steady_request_per_s`: the rate requests
    completed while requests still arrived, from the first completion to the last send (the
    completions after the first, over that span), so neither the ramp before the first reply
    nor the drain after the last send moves it; left out when no completion came before the
    last send (a burst, or every request slower than the arrivals)."""
    if not results:
        return {}
    last_send = max(r.sent_at for r in results)
    out = {"arrival_window_s": last_send - min(r.sent_at for r in results)}
    done = sorted(r.done_at for r in results if r.ok)
    if done and done[0] < last_send:
        steady = sum(1 for t in done[1:] if t <= last_send)
        out["steady_request_per_s"] = steady / (last_send - done[0])
    return out


def parse_slo(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50` (milliseconds, as `vllm bench serve --goodput`) as a dict."""
    slo = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not ms:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, not {item!r}")
        slo[name] = float(ms)
    return slo
