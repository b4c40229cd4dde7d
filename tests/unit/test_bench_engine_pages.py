"""An engine benchmark times the batch it names (`bench_decode.engine_ms`): its requests neither
wait for KV pages (a pool sized for the prompts alone had the engine preempt most of a batch of
64 and decode 1-3 sequences a step) nor end within the timed steps (requests prefilled first
lead the last by a token per prefill step: at 64 x 4096 they ended within the window and the
bench timed 64 to 32 sequences as 64)."""

from __future__ import annotations

import pytest

from bench.bench_decode import engine_ms
from bench.gpu_common import PAGE_SIZE, kv_pages
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol import SamplingParams


def engine(model: str, batch: int, context: int, max_batched: int) -> Engine:
    return Engine(EngineConfig(
        model=model, device="cpu", dtype="float32", page_size=PAGE_SIZE, max_num_seqs=batch,
        num_kv_pages=kv_pages([(batch, context)], max_batched), max_num_batched_tokens=max_batched,
    ))  # fmt: skip


def test_an_engine_run_times_its_whole_batch(tiny_llama: str) -> None:
    batch, context = 8, 64
    e = engine(tiny_llama, batch, context, max_batched=48)  # eleven prefill steps
    assert engine_ms(e, batch, context) > 0  # raises if a timed step ran fewer than 8
    assert e.scheduler.num_preemptions == 0


def test_a_run_whose_requests_end_within_the_timed_steps_is_refused(tiny_llama: str) -> None:
    batch, context = 8, 64
    e = engine(tiny_llama, batch, context, max_batched=96)
    short = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with pytest.raises(RuntimeError, match="did not all run 8 sequences"):
        engine_ms(e, batch, context, short)
