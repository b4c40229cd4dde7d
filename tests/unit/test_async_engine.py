"""AsyncEngine: concurrent streams, rejection of one bad request, abort on a dropped listener;
with and without overlap scheduling."""

from __future__ import annotations

import asyncio

import pytest

from workers.config import EngineConfig
from workers.engine_core import Engine, RequestRejectedError
from workers.engine_loop import AsyncEngine
from workers.protocol import GenerateRequest, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(request: pytest.FixtureRequest):
    eng = AsyncEngine(Engine(EngineConfig(max_model_len=256, overlap_scheduling=request.param)))
    assert eng.engine.overlap is request.param
    yield eng
    eng.shutdown()


async def collect(engine: AsyncEngine, rid: str, ids: list[int], n: int) -> list[int]:
    req = GenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
    )
    tokens: list[int] = []
    async for chunk in engine.generate(req):
        tokens += chunk.token_ids
    return tokens


async def test_concurrent_streams_complete_and_a_bad_request_fails_alone(engine) -> None:
    good = [collect(engine, f"g{i}", [10 + i, 20, 30], 8) for i in range(4)]
    bad = collect(engine, "too-long", [5] * 300, 8)
    results = await asyncio.gather(*good, bad, return_exceptions=True)
    assert all(isinstance(r, list) and len(r) == 8 for r in results[:4])
    assert isinstance(results[4], RequestRejectedError)
    assert "maximum context length" in str(results[4])


async def test_listener_that_goes_away_aborts_and_frees_pages(engine) -> None:
    req = GenerateRequest(
        request_id="dropped",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=200, ignore_eos=True),
    )
    stream = engine.generate(req)
    await stream.__anext__()
    await stream.aclose()  # what a client disconnect does to the consumer
    for _ in range(100):
        await asyncio.sleep(0.05)
        stats = engine.stats()
        if stats.num_running == 0 and stats.kv_pages_pinned == 0:
            break
    assert stats.num_running == 0 and stats.kv_pages_pinned == 0
