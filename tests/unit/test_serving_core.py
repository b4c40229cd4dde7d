"""The serving core: prefix cache, chunked prefill, preemption and aborts keep tokens exact."""

from __future__ import annotations

import random

import pytest

from tests.engine_checks import drain_and_check_released
from workers import LLM, SamplingParams
from workers.config import EngineConfig
from workers.engine.engine import Engine, RequestRejectedError
from workers.protocol import GenerateRequest

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer briefly and truthfully. " * 12


def prompts(llm: LLM, n: int) -> list[list[int]]:
    questions = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(n)]
    return [llm.tokenizer.encode(SYSTEM + q) for q in questions]


# Tokens exact under chunking, prefix caching and preemption is bookkeeping, not weights: these
# run on the tiny random Llama (~30x faster a step than SmolLM2; test_engine_matches_hf.py
# holds SmolLM2 to HF's tokens).
@pytest.fixture(scope="module")
def reference(tiny_llama: str) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=100_000)
    ps = prompts(llm, 6)
    return ps, [o.token_ids for o in llm.generate(ps, GREEDY)]


@pytest.mark.parametrize("budget", [16, 64, 100_000])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_same_tokens_with_any_chunk_budget_and_prefix_cache(
    reference, tiny_llama: str, budget: int, prefix_caching: bool
) -> None:
    ps, expected = reference
    llm = LLM(tiny_llama, enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    first = llm.generate(ps[:1], GREEDY)  # warms the prefix cache for the others
    rest = llm.generate(ps[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    if prefix_caching:
        assert all(o.num_cached_tokens > 0 for o in rest)


def test_shared_system_prompt_is_computed_once() -> None:
    llm = LLM(page_size=16)
    ps = prompts(llm, 32)
    shared = len(llm.tokenizer.encode(SYSTEM))
    aligned = (shared // 16) * 16 - 16  # the last shared page may straddle the question
    [first] = llm.generate(ps[:1], SamplingParams(max_tokens=2))
    before = llm.engine.stats().prompt_tokens_computed
    outs = llm.generate(ps[1:], SamplingParams(max_tokens=2))
    computed = llm.engine.stats().prompt_tokens_computed - before
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens >= aligned for o in outs)
    total = sum(len(p) for p in ps[1:])
    assert computed == total - sum(o.num_cached_tokens for o in outs)
    assert computed < total - 31 * aligned + 1
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 31 * aligned
    assert stats.kv_pages_pinned == 0


@pytest.fixture(scope="module")
def short_prompts_reference(tiny_llama: str) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(tiny_llama, enable_prefix_caching=False)
    ps = [llm.tokenizer.encode(f"Item {i}: the history of the number {i} is") for i in range(6)]
    return ps, [o.token_ids for o in llm.generate(ps, LONG_GREEDY)]


LONG_GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_kv_pool_preempts_and_still_gives_exact_tokens(
    short_prompts_reference, tiny_llama: str, prefix_caching: bool
) -> None:
    ps, expected = short_prompts_reference
    # All six fit at admission (~4 pages each at page size 4) but not grown to ~16 pages each.
    llm = LLM(tiny_llama, page_size=4, num_kv_pages=41, enable_prefix_caching=prefix_caching)
    outs = llm.generate(ps, LONG_GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_pages_pinned == 0 and stats.num_running == 0


def test_random_aborts_leave_no_pinned_pages_and_a_consistent_tree(tiny_llama: str) -> None:
    # Page accounting, not tokens: a tiny random model steps ~30x faster than SmolLM2.
    config = EngineConfig(model=tiny_llama, page_size=4, num_kv_pages=400,
                          max_num_batched_tokens=256)  # fmt: skip
    engine = Engine(config)
    rng = random.Random(0)
    base = engine.tokenizer.encode(SYSTEM)
    live: list[str] = []
    for i in range(200):
        ids = base[: rng.randrange(8, len(base))] + [rng.randrange(100, 40000) for _ in range(5)]
        rid = f"r{i}"
        engine.add_request(
            GenerateRequest(
                request_id=rid,
                prompt_token_ids=ids,
                params=SamplingParams(max_tokens=rng.randrange(1, 30), temperature=1.0, seed=i),
            )
        )
        live.append(rid)
        if i % 3 == 0:
            engine.step()
        if rng.random() < 0.8:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort(victim)
    drain_and_check_released(engine)


def test_too_long_request_is_rejected_and_the_engine_keeps_serving() -> None:
    llm = LLM(max_model_len=64)
    with pytest.raises(RequestRejectedError, match="maximum context length is 64"):
        llm.generate([[5] * 80], GREEDY)
    [out] = llm.generate([[5] * 10], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.token_ids) == 4


def test_generation_stops_at_context_limit() -> None:
    llm = LLM(max_model_len=32)
    [out] = llm.generate([[5] * 20], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_stop_string_ends_generation_and_is_cut_from_text() -> None:
    llm = LLM()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [full] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0))
    assert full.text == "The capital of France is Paris."
    [cut] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0, stop=["France"]))
    assert cut.text == "The capital of " and cut.finish_reason == "stop"
    assert cut.stop_reason == "France"
    [kept] = llm.chat(
        chat,
        SamplingParams(
            max_tokens=20, temperature=0, stop="France", include_stop_str_in_output=True
        ),
    )
    assert kept.text == "The capital of France"


def test_stop_string_before_min_tokens_stays_in_the_text() -> None:
    llm = LLM()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=20, temperature=0, stop=["capital"], min_tokens=5)
    [out] = llm.chat(chat, params)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS, after min_tokens
    [cut] = llm.chat(chat, params.model_copy(update={"stop": ["capital", "Paris"]}))
    assert cut.text == "The capital of France is " and cut.stop_reason == "Paris"


def test_min_tokens_keeps_stop_tokens_from_being_sampled() -> None:
    """As vLLM: before `min_tokens` output tokens, EOS (and stop_token_ids) get no probability,
    so the answer runs on where it would have ended, rather than emitting EOS and going on."""
    llm = LLM()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [plain] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0))
    assert len(plain.token_ids) == 8 and plain.token_ids[-1] in llm.engine.eos_token_ids
    [held] = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0, min_tokens=12))
    assert len(held.token_ids) >= 12 and held.token_ids[:7] == plain.token_ids[:7]
    assert not set(held.token_ids[:12]) & llm.engine.eos_token_ids
    assert held.text.startswith(plain.text)


def test_eos_ends_generation_unless_ignored() -> None:
    llm = LLM()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [stopped] = llm.chat(chat, SamplingParams(max_tokens=40, temperature=0))
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids[-1] in llm.engine.eos_token_ids
    [ignored] = llm.chat(chat, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: str) -> None:
    llm = LLM(tiny_llama)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    [alone] = llm.generate(["Tell me a story about"], p)
    together = llm.generate(
        ["Tell me a story about", "Another prompt", "A third"],
        [p, SamplingParams(max_tokens=8), SamplingParams(max_tokens=30)],
    )
    assert together[0].token_ids == alone.token_ids
