"""Structured outputs on the real engine (SmolLM2, CPU): regex, choice, EBNF and JSON-schema
constraints hold; greedy constrained tokens are HF's greedy tokens under the same mask;
allowed_token_ids, min_tokens, overlap scheduling, preemption and abort keep working; a bad spec
is a clear error."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from tests.engine_checks import drain_and_check_released
from workers.api import check_structured_outputs
from workers.llm import LLM
from workers.protocol import GenerateRequest, SamplingParams, StructuredOutputs
from workers.sampling.grammar import GrammarCompiler, compile_matcher, vocab_tokenizer
from workers.sampling.token_mask import apply_bitmask

SCHEMAS: list[dict[str, Any]] = [
    {  # nested object, enum, bounded integer
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "none"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "pet", "address"],
        "additionalProperties": False,
    },
    {  # array of bounded numbers, optional field
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 3,
            },
            "comment": {"type": "string", "maxLength": 10},
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    {  # array of objects, booleans
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 6},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["sku", "ok"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
]


def greedy(spec: StructuredOutputs | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 80),
                          structured_outputs=spec, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(num_kv_pages=96, page_size=16)


def test_regex_choice_and_ebnf_hold(llm: LLM) -> None:
    regex = r"(Paris|Rome|Berlin) is in (France|Italy|Germany)\."
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'
    outs = llm.generate(
        ["The capital of France:", "Pick a colour:", "What is 6 times 7?"],
        [
            greedy(StructuredOutputs(regex=regex)),
            greedy(StructuredOutputs(choice=("red", "green", "blue"))),
            greedy(StructuredOutputs(grammar=grammar)),
        ],
    )
    assert [o.finish_reason for o in outs] == ["stop"] * 3, [o.error for o in outs]
    assert re.fullmatch(regex, outs[0].text), outs[0].text
    assert outs[1].text in ("red", "green", "blue")
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", outs[2].text), outs[2].text


def test_json_schemas_hold_greedy_and_sampled(llm: LLM) -> None:
    prompts = [f"Write record {i} as JSON:" for i in range(len(SCHEMAS))] + ["Any JSON object:"]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=80,
                       structured_outputs=StructuredOutputs(json_schema=schema))
        for i, schema in enumerate(SCHEMAS)
    ] + [greedy(StructuredOutputs(json_object=True), max_tokens=40)]  # fmt: skip
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs[:-1]):
        assert out.finish_reason == "stop", (i, out.text, out.error)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i])
    anything = outs[-1]  # any object: a small model may fill one string up to max_tokens
    assert anything.text.startswith("{") and anything.error is None
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.text), dict)


def test_greedy_constrained_tokens_are_hf_greedy_under_the_same_mask(
    llm: LLM, hf_smollm2: Any
) -> None:
    from tests.conftest import hf_greedy

    spec = StructuredOutputs(json_schema=SCHEMAS[1])
    prompt = llm.tokenizer.encode("Scores as JSON:")
    [out] = llm.generate([prompt], greedy(spec, max_tokens=30))
    assert out.finish_reason == "stop"
    tok = vocab_tokenizer(llm.tokenizer, llm.engine.runner.model_config.vocab_size)
    matcher = compile_matcher(spec, tok)

    def masked(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        produced = ids[0, len(prompt) :].tolist()
        if produced:
            assert matcher.consume_token(produced[-1])
        mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        apply_bitmask(scores, mask, torch.arange(1))
        return scores

    ref = hf_greedy(hf_smollm2, prompt, len(out.token_ids), processors=masked)
    assert out.token_ids == ref


def test_allowed_token_ids_and_min_tokens(llm: LLM) -> None:
    allowed = tuple(llm.tokenizer.encode(" yes no maybe"))
    eos = llm.tokenizer.eos_token_id
    outs = llm.generate(
        ["Answer:", "Yes or no?"],
        [
            greedy(max_tokens=8, allowed_token_ids=allowed),
            # the grammar ends the request even under min_tokens: it allows nothing more
            greedy(StructuredOutputs(choice=("yes", "no")), min_tokens=6),
        ],
    )
    assert outs[0].token_ids and set(outs[0].token_ids) <= set(allowed)
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason == "stop"
    assert eos not in outs[1].token_ids


def test_max_tokens_cuts_a_grammar(llm: LLM) -> None:
    [out] = llm.generate(["JSON:"], greedy(StructuredOutputs(json_schema=SCHEMAS[0]), max_tokens=5))
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_overlap_scheduling_gives_the_same_constrained_tokens(llm: LLM) -> None:
    specs = [StructuredOutputs(json_schema=SCHEMAS[1]), StructuredOutputs(choice=("alpha", "beta"))]
    prompts = [f"Record {i} as JSON:" for i in range(len(specs))]
    params = [greedy(s, max_tokens=30) for s in specs]
    ref = llm.generate(prompts, params)
    other = LLM(num_kv_pages=96, page_size=16, overlap_scheduling=True)
    ours = other.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in ours] == ["stop"] * len(specs)
    drain_and_check_released(other.engine)


def test_requests_of_one_spec_on_several_compiled_copies_match_one_copy(llm: LLM) -> None:
    """The fixture's engine spreads these requests over compiled copies of the schema (shards,
    filled on several threads in shard order); one shard gives the same tokens."""
    spec = StructuredOutputs(json_schema=SCHEMAS[1])
    prompts = [f"Record {i} as JSON:" for i in range(5)]
    params = greedy(spec, max_tokens=30)
    one = LLM(num_kv_pages=96, page_size=16, grammar_threads=1)
    assert llm.engine.cfg.grammar_threads >= len(prompts)
    ref = one.generate(prompts, params)
    ours = llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "stop" for o in ours)
    drain_and_check_released(one.engine)


def test_the_compiler_hands_out_a_specs_shards_in_turn(llm: LLM) -> None:
    vocab = llm.engine.runner.model_config.vocab_size
    compiler = GrammarCompiler(lambda: vocab_tokenizer(llm.tokenizer, vocab), shards=3)
    digits = [compiler.submit(StructuredOutputs(regex="[0-9]+")) for _ in range(7)]
    matchers = [f.result() for f in digits]
    assert len({id(m) for m in matchers}) == 3
    assert matchers[3:6] == matchers[:3] and matchers[6] is matchers[0]
    bad = compiler.submit(StructuredOutputs(regex="[0-9"))
    with pytest.raises(ValueError, match="regex"):
        bad.result()
    assert all(compiler.submit(StructuredOutputs(regex="[0-9")) is bad for _ in range(4))
    compiler.close()


def test_preemption_keeps_constrained_outputs(llm: LLM) -> None:
    spec = StructuredOutputs(json_schema=SCHEMAS[1])
    prompts = [f"Scores for team {i} as JSON:" for i in range(3)]
    params = greedy(spec, max_tokens=30)
    ref = llm.generate(prompts, params)
    small = LLM(num_kv_pages=8, page_size=8)  # 3 sequences of ~3 pages cannot all stay
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    drain_and_check_released(small.engine)


def test_abort_frees_a_constrained_request(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode("JSON please:")
    spec = StructuredOutputs(json_schema=SCHEMAS[2])
    engine.add_request(GenerateRequest(request_id="ab", prompt_token_ids=ids,
                                       params=greedy(spec, max_tokens=200)))  # fmt: skip
    for _ in range(20):
        engine.step()
        if engine.seqs["ab"].num_output_tokens >= 2:
            break
    assert engine.seqs["ab"].num_output_tokens >= 2
    out = engine.abort("ab")
    assert out is not None and out.finish_reason == "abort"
    drain_and_check_released(engine)


def test_an_invalid_spec_is_a_clear_error(llm: LLM) -> None:
    bad = StructuredOutputs(regex="[0-9")
    with pytest.raises(ValueError, match="regex"):
        check_structured_outputs(bad, llm.tokenizer)
    with pytest.raises(ValueError, match="not valid JSON"):
        check_structured_outputs(StructuredOutputs(json_schema='{"type": '), llm.tokenizer)
    check_structured_outputs(StructuredOutputs(json_schema=SCHEMAS[0]), llm.tokenizer)
    [out] = llm.generate(["x"], greedy(bad))  # the engine, given it anyway
    assert out.finish_reason == "error" and out.error and "regex" in out.error
    assert not out.token_ids
    drain_and_check_released(llm.engine)
