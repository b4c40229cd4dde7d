"""Speculative decoding (CPU): greedy outputs are the target's alone, sampled outputs follow the
target's distribution, stops / limits / logprobs / penalties / grammars / preemption hold when
several tokens land in one step, rejected drafts' pages are freed, and the counters add up."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.engine_checks import drain_and_check_released, engine_pair
from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.engine import Engine
from workers.llm import LLM, GenerationOutput
from workers.protocol import GenerateRequest, SamplingParams, StructuredOutputs
from workers.sampling.sampler import accept_or_resample, race
from workers.sequence import Sequence
from workers.spec.ngram import TokenArrays, propose_ngram

PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the weather "
    "in his log: wind from the west, a light rain, the sea calm."
)
REWRITE = f"Copy this sentence exactly, then stop.\n{PASSAGE}\n"


def ngram(k: int = 4) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k}


def draft(model: str, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": k, "model": model,
            "draft_kv_cache_memory_gb": 0.1}  # fmt: skip


SMALL = {"kv_cache_memory_gb": 0.1}  # KV pools of a fraction of the 1 GiB default: quicker


def same_tokens(got: list[GenerationOutput], want: list[GenerationOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    tokens = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose_ngram(tokens, 3, 1, 4) == [4, 5, 9]  # the 3-gram [1, 2, 3] at 0
    assert propose_ngram(np.array([7, 1, 8, 1, 9, 1]), 2, 1, 4) == [9, 1]  # the latest [1]
    assert propose_ngram(np.array([5, 6, 7]), 3, 1, 4) == []
    assert propose_ngram(np.array([5, 6, 5]), 3, 2, 4) == []  # no 2-gram repeats
    assert propose_ngram(np.array([0, 3, 1, 4, 2, 4, 2, 3]), 4, 1, 4) == [1, 4, 2, 4]
    arrays, seq = TokenArrays(), Sequence("s", [1, 2], 1, SamplingParams(), None)
    for token in range(3, 40):  # grows with the sequence, converting only the new tokens
        assert arrays.get(seq).tolist() == seq.token_ids
        seq.token_ids.append(token)


def test_config_needs_a_draft_model_for_draft_model() -> None:
    with pytest.raises(ValueError, match="speculative.model"):
        SpeculativeConfig(method="draft_model")
    cfg = EngineConfig(speculative={"method": "ngram"})  # type: ignore[arg-type]
    assert cfg.speculative is not None and not cfg.resolved_overlap(torch.device("cuda"))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Whatever the draft (likely, unlikely, impossible), each row's token follows p; it equals
    the draft exactly when accepted, and seeded rows reproduce."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 20000
    for x in (0, 3, 4):
        probs = p.expand(n, -1).contiguous()
        drafts = torch.full((n,), x)
        noise = torch.empty_like(probs).exponential_()
        tokens = accept_or_resample(probs, noise, drafts, drafts.numpy(), [None] * n)
        freq = torch.bincount(tokens, minlength=5).float() / n
        assert (freq - p).abs().sum() / 2 < 0.015, (x, freq)
    no_draft = accept_or_resample(
        probs[:4], noise[:4], torch.full((4,), -1), np.full(4, -1), [None] * 4
    )
    assert torch.equal(no_draft, race(probs[:4], noise[:4]))

    def seeded() -> torch.Tensor:
        gens = [torch.Generator().manual_seed(s) for s in range(8)]
        noise = torch.stack([torch.empty(5).exponential_(generator=g) for g in gens])
        return accept_or_resample(
            p.expand(8, -1),
            noise,
            torch.full((8,), 1),
            np.ones(8),
            gens,  # type: ignore[arg-type]
        )

    assert torch.equal(seeded(), seeded())


def test_sampled_tokens_follow_the_target_through_the_engine(tiny_llama: str) -> None:
    """Every output token of a long sampled request whose drafts are the target's own greedy
    tokens (so each draft is its most likely token, accepted with that token's probability)
    follows the target's distribution at its position: its rank among the top 4 (top_k=4), over
    all positions, against the expected counts from the logprobs the engine reports (a
    chi-square test). Always keeping the draft would inflate rank 1."""
    params = SamplingParams(max_tokens=60, temperature=1.0, top_k=4, ignore_eos=True,
                            logprobs=4, seed=0)  # fmt: skip
    llm = LLM(tiny_llama, speculative=draft(tiny_llama, k=3), **SMALL)
    out = llm.generate([[1, 422, 1205, 315, 260]], params)[0]
    assert out.logprobs is not None and out.num_draft_tokens > 30
    counts, expected = np.zeros(4), np.zeros(4)
    for lp in out.logprobs[1:]:  # the first token is the prefill's: no draft
        ids, logprobs = zip(*sorted(lp.top.items(), key=lambda kv: -kv[1]))
        p = np.exp(logprobs) / np.exp(logprobs).sum()
        expected += p
        counts[ids.index(lp.token_id)] += 1  # raises if outside the top 4
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3, (counts, expected)  # p = 0.001 at 3 degrees of freedom
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens


MIXED = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=0.5, repetition_penalty=1.2, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, stop_token_ids=[28],
                   logit_bias={"13": -100}),
    SamplingParams(max_tokens=20, temperature=0.0,  # prompt lookup drafts what it allows
                   structured_outputs=StructuredOutputs(choice=(" hello" * 8,))),
    SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, seed=3, top_p=0.9, logprobs=1),
]  # fmt: skip
PROMPTS = ["a b c d a b c d a b", "Say cat many times: cat cat cat", "Item 3: the history of",
           "hello hello hello", "one two one two one", "The sea, the sea, the"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama: str) -> list[GenerationOutput]:
    return LLM(tiny_llama, **SMALL).generate(PROMPTS, MIXED)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_several_tokens_a_step_keep_every_rule(
    tiny_llama: str, tiny_reference: list[GenerationOutput], method: str
) -> None:
    """Penalties, min_tokens, logit bias, a grammar, max_tokens and logprobs under speculation
    (tiny random model; its own greedy drafts, so many are accepted): greedy requests keep the
    target's tokens and logprobs; the seeded request reproduces; no page is left held."""
    spec = ngram(3) if method == "ngram" else draft(tiny_llama)
    llm = LLM(tiny_llama, speculative=spec, **SMALL)
    outs = llm.generate(PROMPTS, MIXED)
    same_tokens(outs[:5], tiny_reference[:5])
    if method == "ngram":  # drafts the grammar accepts, masked at every position
        assert outs[3].num_accepted_tokens > 0
    for got, want in zip(outs[:5], tiny_reference[:5]):
        if want.logprobs is not None:
            assert got.logprobs is not None
            assert [lp.top.keys() for lp in got.logprobs] == [lp.top.keys() for lp in want.logprobs]
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-4
            )
    again = llm.generate(PROMPTS[5:], MIXED[5:])
    assert again[0].token_ids == outs[5].token_ids and len(outs[5].token_ids) > 0
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens == sum(o.num_draft_tokens for o in outs + again) > 0
    assert stats.spec_num_accepted_tokens == sum(o.num_accepted_tokens for o in outs + again)
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    steps = stats.spec_num_drafts
    assert stats.spec_accepted_per_pos == sorted(stats.spec_accepted_per_pos, reverse=True)
    assert stats.spec_accepted_per_pos[0] <= steps
    assert stats.generation_tokens == sum(len(o.token_ids) for o in outs + again)
    drain_and_check_released(llm.engine)
    spec_state = llm.engine.spec
    if spec_state is not None and spec_state.draft is not None:
        allocator = spec_state.draft.kv.allocator
        assert allocator.num_free == allocator.num_usable


def test_rejected_drafts_pages_are_freed_and_preemption_holds(
    tiny_llama: str, tiny_reference: list[GenerationOutput]
) -> None:
    """A pool of a few pages: sequences are preempted and recomputed while they speculate; after
    every step a running sequence holds pages for its tokens only (the rejected drafts' pages
    went back), and the outputs are the reference's."""
    engine = Engine(EngineConfig(model=tiny_llama, num_kv_pages=14, page_size=4,
                                 speculative=draft(tiny_llama, k=4)))  # fmt: skip
    tokenizer = engine.tokenizer
    for i, (prompt, p) in enumerate(zip(PROMPTS[:5], MIXED[:5])):
        ids = tokenizer.encode(prompt)
        engine.add_request(GenerateRequest(request_id=str(i), prompt_token_ids=ids, params=p))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(5)}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        for seq in engine.scheduler.running:
            assert len(seq.pages) <= -(-len(seq.token_ids) // 4)
            assert seq.num_computed_tokens < len(seq.token_ids)
    assert engine.scheduler.num_preemptions > 0
    assert [tokens[str(i)] for i in range(5)] == [o.token_ids for o in tiny_reference[:5]]
    drain_and_check_released(engine)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir: Any) -> list[GenerationOutput]:
    return LLM(**SMALL).generate(SMOLLM2_PROMPTS, SMOLLM2_PARAMS)


SMOLLM2_PROMPTS = [REWRITE]
SMOLLM2_PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, stop=[" west"])]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_smollm2_greedy_outputs_are_the_target_alone(
    smollm2_dir: Any, smollm2_reference: list[GenerationOutput], method: str
) -> None:
    """SmolLM2's greedy outputs with speculation are those without (the draft model is SmolLM2
    itself), and drafts were accepted."""
    spec = ngram() if method == "ngram" else draft(str(smollm2_dir))
    outs = LLM(speculative=spec, **SMALL).generate(SMOLLM2_PROMPTS, SMOLLM2_PARAMS)
    same_tokens(outs, smollm2_reference)
    assert outs[0].stop_reason == " west"  # the stop string lands inside a run of drafts
    assert sum(o.num_accepted_tokens for o in outs) > 0


def test_disaggregated_the_decode_side_speculates_and_prefills_its_draft(
    tiny_llama: str, tiny_reference: list[GenerationOutput]
) -> None:
    """A PrefillEngine and a DecodeEngine in one process (NIXL over DRAM), both configured to
    speculate: the prefill side loads no draft and drafts nothing; the decode side computes the
    draft's prompt KV itself and its output is the colocated engine's."""
    cfg = EngineConfig(model=tiny_llama, num_kv_pages=64, page_size=16,
                       speculative=draft(tiny_llama))  # fmt: skip
    with engine_pair(cfg) as (prefill, decode):
        assert prefill.spec is None and decode.spec is not None
        ids = prefill.tokenizer.encode(PROMPTS[0])
        req = GenerateRequest(request_id="h", prompt_token_ids=ids, params=MIXED[0])
        prefill.add_request(req)
        first = None
        while first is None:
            first = next(iter(prefill.step()), None)
        decode.add_remote(req, first)
        chunks = [first]
        while not chunks[-1].finished:
            prefill.poll()
            chunks += decode.poll() + decode.step()
        assert sum((c.token_ids for c in chunks), []) == tiny_reference[0].token_ids
        assert chunks[-1].num_accepted_tokens > 0 and decode.stats().num_recomputed == 0
