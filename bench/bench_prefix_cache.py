"""Shared-prefix workload: throughput and mean TTFT with the prefix cache on vs off, one run.

python -m bench.bench_prefix_cache [--out DIR]

64 requests by default: a 512-token system prompt + 64-token questions.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from bench.results_io import add_out_argument, write_result
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.protocol import GenerateRequest, SamplingParams


def workload(n: int, system_len: int, question_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40000, (system_len,), generator=g).tolist()
    return [
        system + torch.randint(100, 40000, (question_len,), generator=g).tolist() for _ in range(n)
    ]


async def run(engine: AsyncEngine, prompts: list[list[int]], out_len: int) -> tuple[float, float]:
    """Submit every prompt at once; returns (seconds, mean TTFT seconds)."""
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ttfts: list[float] = []

    async def one(i: int, ids: list[int]) -> None:
        req = GenerateRequest(request_id=f"b{i}-{start}", prompt_token_ids=ids, params=params)
        first = True
        async for _ in engine.generate(req):
            if first:
                ttfts.append(time.perf_counter() - start)
                first = False

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, sum(ttfts) / len(ttfts)


def measure(prefix_caching: bool, prompts: list[list[int]], out_len: int) -> tuple[float, float]:
    engine = AsyncEngine(Engine(EngineConfig(enable_prefix_caching=prefix_caching)))
    try:
        asyncio.run(run(engine, prompts[:1], 2))  # warm-up (and, with the cache, the prefix)
        return asyncio.run(run(engine, prompts, out_len))
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    add_out_argument(ap)
    args = ap.parse_args()
    prompts = workload(args.requests, args.system_len, args.question_len)
    on = measure(True, prompts, args.output_len)
    off = measure(False, prompts, args.output_len)
    tokens = args.requests * args.output_len
    print(
        f"{args.requests} requests: {args.system_len}-token shared prefix + "
        f"{args.question_len}-token questions, {args.output_len} out, SmolLM2 CPU"
    )
    print(f"{'prefix cache':<14}{'seconds':>10}{'out tok/s':>12}{'mean TTFT s':>13}")
    for name, (secs, ttft) in (("on", on), ("off", off)):
        print(f"{name:<14}{secs:>10.2f}{tokens / secs:>12.1f}{ttft:>13.2f}")
    print(f"throughput on/off: {off[0] / on[0]:.2f}x   mean TTFT off/on: {off[1] / on[1]:.2f}x")
    rows = [
        dict(prefix_cache=name, seconds=round(secs, 1), out_tok_per_s=round(tokens / secs, 1),
             mean_ttft_s=round(ttft, 1), x_off_throughput=round(off[0] / secs, 1),
             x_off_ttft=round(off[1] / ttft, 1))
        for name, (secs, ttft) in (("on", on), ("off", off))
    ]  # fmt: skip
    model = (
        f"SmolLM2-135M-Instruct on CPU: {args.requests} requests, a shared {args.system_len}-token"
        f" prefix + {args.question_len}-token questions, {args.output_len} out"
    )
    write_result(args.out, "prefix-cache", rows, model=model)


if __name__ == "__main__":
    main()
