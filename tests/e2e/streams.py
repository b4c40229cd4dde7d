"""Concurrent greedy streams through HTTP, as the failover tests send and compare them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

NEAR_TIE = 1e-3  # nats: float noise between a decode step and a resumed stream's recompute


@dataclass
class Streamed:
    status: int
    tokens: list[str]  # as the logprobs name them, one per token
    text: str
    gaps: list[float]  # each token's top-2 log-prob gap: a near-tie where it is tiny
    took: float
    error: str = ""


@dataclass(frozen=True)
class Ask:
    prompt: str
    max_tokens: int


async def stream(c: httpx.AsyncClient, model: str, ask: Ask) -> Streamed:
    """One greedy streamed completion: its status, tokens, text, top-2 gaps and seconds taken;
    an error event in the stream is kept in `error`."""
    body = {"model": model, "prompt": ask.prompt, "max_tokens": ask.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 2}  # fmt: skip
    t0 = time.monotonic()
    tokens, text, gaps = [], [], []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            error = (await r.aread()).decode()
            return Streamed(r.status_code, [], "", [], time.monotonic() - t0, error)
        async for line in r.aiter_lines():
            if '"error"' in line:
                return Streamed(500, tokens, "".join(text), gaps, time.monotonic() - t0, line)
            if line.startswith("data: {"):
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                text.append(choice["text"])
                tokens += choice["logprobs"]["tokens"]
                for top in choice["logprobs"]["top_logprobs"]:
                    best = sorted(top.values(), reverse=True)
                    gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return Streamed(200, tokens, "".join(text), gaps, time.monotonic() - t0)


def wave(base_url: str, model: str, asks: list[Ask], timeout_s: float = 300) -> list[Streamed]:
    """`asks` streamed at once."""

    async def run() -> list[Streamed]:
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as c:
            return await asyncio.gather(*(stream(c, model, a) for a in asks))

    return asyncio.run(run())


def same_or_near_tie(got: Streamed, want: Streamed) -> bool:
    """Every token streamed, and the same tokens up to a first difference where the undisturbed
    run's top two were within float noise: a resumed stream recomputes its context's KV (a tiny
    random model's logits are close together), so a near-tie may fall the other way."""
    if got.status != 200 or len(got.tokens) != len(want.tokens):
        return False
    diverged = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b), None)
    return diverged is None or want.gaps[diverged] < NEAR_TIE


def pinned(base_url: str) -> float:
    """KV pages pinned for hand-offs, summed over every replica of the application."""
    rows = httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines()
    return sum(float(r.split()[-1]) for r in rows if r.startswith("pdserve:kv_pages_pinned{"))
