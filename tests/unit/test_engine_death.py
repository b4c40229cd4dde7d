"""A step that raises kills the engine (the injected sticky step fault, in the real launch path):
its requests end with `EngineDeadError`, new ones are refused with it, its pages are freed, its
health check fails; a request's own error still fails that request alone. The router counts the
error as a replica's failure, also wrapped as Ray wraps it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from router.failover import is_replica_failure
from workers.config import EngineConfig, FaultConfig, KVTransferConfig
from workers.disagg.decode import DecodeEngine
from workers.engine.async_engine import AsyncEngine
from workers.engine_stats import EngineDeadError
from workers.protocol import GenerateRequest, RequestOutput, SamplingParams, StructuredOutputs

AFTER = 6  # the step the fault strikes first


@pytest.fixture()
def engine(tiny_llama: str) -> Iterator[DecodeEngine]:
    cfg = EngineConfig(
        model=tiny_llama, num_kv_pages=64, page_size=16, stream_interval_ms=0,
        faults=(FaultConfig(point="step", action="raise", role="decode", after=AFTER),),
    )  # fmt: skip
    eng = DecodeEngine(cfg, KVTransferConfig())
    yield eng
    eng.agent.close()  # its NIXL agent: none may outlive the test process's Ray


def request(rid: str, n: int = 40, **kw: object) -> GenerateRequest:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)
    return GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8 + len(rid)], params=params)


async def consume(loop: AsyncEngine, req: GenerateRequest) -> list[RequestOutput]:
    chunks = []
    async for chunk in loop.generate(req):
        chunks.append(chunk)
    return chunks


def test_a_failing_step_kills_the_engine_and_frees_its_pages(engine: DecodeEngine) -> None:
    async def run() -> None:
        loop = AsyncEngine(engine)
        try:
            # a request's own error (a grammar that cannot compile) fails it alone, first
            bad = request("bad", structured_outputs=StructuredOutputs(json_schema='{"type": '))
            failed = await consume(loop, bad)
            assert failed[-1].finish_reason == "error" and engine.dead is None
            streams = [consume(loop, request(f"r{i}")) for i in range(3)]
            results = await asyncio.gather(*streams, return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "injected fault" in str(results[0])
            with pytest.raises(EngineDeadError):  # new requests are refused with it
                await consume(loop, request("late"))
            with pytest.raises(EngineDeadError):  # Serve's health check fails
                loop.check_alive()
            await asyncio.sleep(0.2)  # the loop's next stats refresh
            stats = loop.stats()
            assert stats.engine_deaths == {"RuntimeError": 1} and stats.dead
            assert (stats.num_running, stats.num_waiting, stats.kv_pages_pinned) == (0, 0, 0)
            assert engine.kv.num_used_pages == stats.kv_pages_cached  # only the prefix cache
            assert not engine.seqs
        finally:
            loop.shutdown()

    asyncio.run(run())


def test_the_fault_strikes_every_step_from_the_after_th(engine: DecodeEngine) -> None:
    engine.add_request(request("a", n=AFTER + 4))
    tokens = []
    for _ in range(AFTER - 1):
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert len(tokens) == AFTER - 1 and engine.dead is None
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):  # it stays dead
        engine.add_request(request("b"))
    assert engine.faults is not None and engine.faults.held == [True]  # sticky
    assert not engine.has_work() and engine.kv.num_pinned_pages == 0


def test_an_engine_death_is_a_replica_failure_also_wrapped_by_ray() -> None:
    from ray.exceptions import RayTaskError

    dead = EngineDeadError("the engine died: RuntimeError: CUDA error")
    assert is_replica_failure(dead)
    try:
        raise dead
    except EngineDeadError as e:
        wrapped = RayTaskError("generate", "traceback", e)
    assert is_replica_failure(wrapped)
    assert is_replica_failure(wrapped.as_instanceof_cause())  # what a Serve call raises
    assert not is_replica_failure(RayTaskError("generate", "traceback", ValueError("bad")))
