"""An engine benchmark times the batch it names: the pool `decode_config` sizes holds every request
of `bench_decode.engine_ms` to its last token (a pool sized for the prompts alone had the engine
preempt most of a batch of 64 for pages and decode 1-3 sequences a step)."""

from __future__ import annotations

import random

from bench.gpu_common import ENGINE_RUN, ENGINE_STEPS, ENGINE_WARMUP, PAGE_SIZE, kv_pages
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol import GenerateRequest, SamplingParams


def test_the_pool_holds_every_request_of_an_engine_run(tiny_llama: str) -> None:
    batch, context = 8, 64
    engine = Engine(EngineConfig(model=tiny_llama, device="cpu", dtype="float32",
                                 page_size=PAGE_SIZE, num_kv_pages=kv_pages([(batch, context)]),
                                 max_num_seqs=batch))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=ENGINE_RUN, ignore_eos=True)
    rng = random.Random(0)
    for i in range(batch):
        ids = tuple(rng.randrange(1000, 30000) for _ in range(context))
        engine.add_request(GenerateRequest(request_id=f"e{i}", prompt_token_ids=ids, params=params))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step()}
    for _ in range(ENGINE_WARMUP + ENGINE_STEPS):
        engine.step()
        assert len(engine.scheduler.running) == batch
    assert engine.scheduler.num_preemptions == 0
