"""Overlap scheduling (step n+1 launched before step n is read) keeps every result exact.

On the CPU the device work runs inside `launch()`, so these tests check the bookkeeping, not
the speed: tokens fed from the running step, the extra token of finished sequences, and pages
held until the step that writes them is done.
"""

from __future__ import annotations

import random

import pytest

from tests.engine_checks import drain_and_check_released
from workers import LLM, SamplingParams
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol import GenerateRequest

PROMPTS = [f"Item {i}: the history of the number {i} is" for i in range(5)] + [
    "What is the capital of France? Answer:",
    "Say the word cat many times: cat cat",
    "Say the word dog many times: dog dog",
    "What is the capital of Italy? Answer:",
]


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling with logprobs, stop strings, EOS and short limits, penalties and
    min_tokens (which count the newest token, still on the device under overlap), side by
    side."""
    return [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0.0, stop=[" the"]),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, min_p=0.05, seed=3),
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
            presence_penalty=0.5, repetition_penalty=1.2,
        ),
        SamplingParams(
            max_tokens=24, temperature=0.7, seed=5, ignore_eos=True, frequency_penalty=2.0,
            logit_bias={"13": -100}, logprobs=1,
        ),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, stop_token_ids=[28]),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def synchronous() -> list:
    llm = LLM(overlap_scheduling=False)
    return llm.generate(PROMPTS, mixed_params())


@pytest.mark.parametrize("budget", [8, 2048])
def test_overlap_gives_the_synchronous_outputs(synchronous, budget: int) -> None:
    llm = LLM(overlap_scheduling=True, max_num_batched_tokens=budget)
    assert llm.engine.overlap
    outs = llm.generate(PROMPTS, mixed_params())
    for got, want in zip(outs, synchronous, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        if want.logprobs is not None:
            assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-4
            )
    assert [len(o.token_ids) for o in outs[:2]] == [30, 20]
    assert len(outs[3].token_ids) == 1
    stats = llm.engine.stats()
    assert stats.kv_pages_pinned == 0 and stats.num_running == 0
    assert stats.generation_tokens == sum(len(o.token_ids) for o in outs)


def test_aborted_sequence_keeps_its_pages_until_the_running_step_ends(tiny_llama: str) -> None:
    engine = Engine(
        EngineConfig(model=tiny_llama, overlap_scheduling=True, enable_prefix_caching=False)
    )
    usable = engine.allocator.num_usable
    for rid, start in (("a", 100), ("b", 200)):
        engine.add_request(
            GenerateRequest(
                request_id=rid,
                prompt_token_ids=list(range(start, start + 40)),
                params=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            )
        )
    while not any(o.request_id == "a" for o in engine.step()):
        pass
    running = engine._running
    assert running is not None and engine.seqs["a"] in running.seqs
    a_pages = len(engine.seqs["a"].pages)
    free = engine.allocator.num_free
    assert engine.abort("a") is not None
    assert engine.allocator.num_free == free  # the running step still writes a's KV
    engine.step()  # ... and is done now
    assert engine.allocator.num_free >= free + a_pages - 1  # b may have taken one page
    while engine.has_work():
        engine.step()
    assert engine.allocator.num_free == usable


def test_context_limit_and_preemption_with_overlap(tiny_llama: str) -> None:
    # bookkeeping: the tiny random Llama (the mixed rules above run on SmolLM2)
    ref = LLM(tiny_llama, overlap_scheduling=False, enable_prefix_caching=False)
    ps = [ref.tokenizer.encode(f"Item {i}: the history of the number {i} is") for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    want = ref.generate(ps, params)
    llm = LLM(tiny_llama, overlap_scheduling=True, page_size=4, num_kv_pages=41)
    got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):  # a recomputed prompt does not add its logprobs twice
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        assert [lp and lp.token_id for lp in g.prompt_logprobs] == [
            lp and lp.token_id for lp in w.prompt_logprobs
        ]
        assert [lp and lp.logprob for lp in g.prompt_logprobs] == pytest.approx(
            [lp and lp.logprob for lp in w.prompt_logprobs], abs=1e-4
        )
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_pages_pinned == 0
    short = LLM(tiny_llama, overlap_scheduling=True, max_model_len=32)
    [out] = short.generate([[5] * 20], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_random_aborts_with_overlap_leave_nothing_behind(tiny_llama: str) -> None:
    # Page accounting, not tokens: a tiny random model steps ~30x faster than SmolLM2.
    engine = Engine(
        EngineConfig(
            model=tiny_llama, overlap_scheduling=True, page_size=4, num_kv_pages=300,
            max_num_batched_tokens=128,
        )
    )  # fmt: skip
    rng = random.Random(1)
    live: list[str] = []
    for i in range(120):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 40))]
        engine.add_request(
            GenerateRequest(
                request_id=f"r{i}",
                prompt_token_ids=ids,
                params=SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0),
            )
        )
        live.append(f"r{i}")
        engine.step()
        if rng.random() < 0.5:
            engine.abort(live.pop(rng.randrange(len(live))))
    drain_and_check_released(engine)


def test_min_tokens_counts_the_token_in_flight() -> None:
    """EOS becomes possible exactly at output token `min_tokens`, also while the step that
    sampled the previous token is still running."""
    llm = LLM(overlap_scheduling=True)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [plain] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0.0))
    ends_at = len(plain.token_ids) - 1  # the index of its EOS
    assert plain.token_ids[-1] in llm.engine.eos_token_ids
    [just] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0.0, min_tokens=ends_at))
    assert just.token_ids == plain.token_ids
    [held] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0.0, min_tokens=ends_at + 1))
    assert held.token_ids[:ends_at] == plain.token_ids[:ends_at]
    assert held.token_ids[ends_at] not in llm.engine.eos_token_ids
