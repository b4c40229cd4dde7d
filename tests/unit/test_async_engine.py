"""AsyncEngine: concurrent streams, rejection of one bad request, abort on a dropped listener;
with and without overlap scheduling."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.waiting import async_wait_until
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine, RequestRejectedError
from workers.protocol import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(request: pytest.FixtureRequest):
    cfg = EngineConfig(max_model_len=256, overlap_scheduling=request.param, stream_interval_ms=0)
    eng = AsyncEngine(Engine(cfg))
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
    await async_wait_until(
        lambda: engine.stats().num_running == 0 and engine.stats().kv_pages_pinned == 0,
        5,
        what="the dropped request's abort",
    )
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_pages_pinned == 0


async def test_a_stream_interval_merges_chunks_and_loses_no_token(engine) -> None:
    """An interval longer than the request: its first chunk goes at once, and every later one
    waits and joins the last chunk, which goes as soon as the request ends. Together they hold
    the same tokens, text and logprobs as the stream of a chunk per token."""

    async def chunks(rid: str) -> list:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        req = GenerateRequest(request_id=rid, prompt_token_ids=[10, 20, 30], params=params)
        return [c async for c in engine.generate(req)]

    each = await chunks("each")
    engine.stream_interval_s = 600.0
    try:
        merged = await asyncio.wait_for(chunks("merged"), timeout=60)
    finally:
        engine.stream_interval_s = 0.0
    assert [len(c.token_ids) for c in each] == [1] * 12
    assert [len(c.token_ids) for c in merged] == [1, 11]
    assert merged[-1].finish_reason == each[-1].finish_reason == "length"
    assert [t for c in merged for t in c.token_ids] == [t for c in each for t in c.token_ids]
    assert "".join(c.text for c in merged) == "".join(c.text for c in each)
    assert [lp for c in merged for lp in c.logprobs] == [lp for c in each for lp in c.logprobs]
    assert merged[-1].num_prompt_tokens == 3


def test_merged_chunks_keep_the_first_ones_prompt_logprobs_and_the_last_ones_end() -> None:
    prompt = [None, TokenLogprob(token_id=7, logprob=-1.0)]
    first = RequestOutput(request_id="r", token_ids=[1], text="a", num_prompt_tokens=2,
                          num_cached_tokens=0, prompt_logprobs=prompt)  # fmt: skip
    last = RequestOutput(request_id="r", token_ids=[2, 3], text="bc", finish_reason="stop",
                         stop_reason="c", num_prompt_tokens=2)  # fmt: skip
    merged = first.then(last)
    assert merged.token_ids == [1, 2, 3] and merged.text == "abc" and merged.logprobs is None
    assert merged.prompt_logprobs == prompt and merged.num_prompt_tokens == 2
    assert (merged.finish_reason, merged.stop_reason) == ("stop", "c")


async def test_a_busy_engine_sends_keepalives_and_a_stalled_one_does_not(engine) -> None:
    """A stream whose engine loop is busy (here: held in a command) gets keepalives; once a step
    has run `stall_s` (faked), none comes (the router then takes the replica for stalled)."""
    release = threading.Event()
    engine.call(lambda: release.wait(10))
    req = GenerateRequest(request_id="busy", prompt_token_ids=[1, 2, 3],
                          params=SamplingParams(max_tokens=2, ignore_eos=True))  # fmt: skip
    stream = engine.stream("busy", lambda: engine.engine.add_request(req), 0.05, 0.3)
    beat = await asyncio.wait_for(anext(stream), 2)
    assert beat.is_keepalive and beat.request_id == "busy"
    engine._step_began = time.monotonic() - 1.0  # as if a step had run for 1 s
    pending = asyncio.ensure_future(anext(stream))
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done  # silent
    engine._step_began = None
    release.set()
    chunks = [await pending] + [c async for c in stream]
    assert sum(len(c.token_ids) for c in chunks if not c.is_keepalive) == 2
    assert chunks[-1].finished
