"""A constrained request across the KV hand-off (a PrefillEngine and a DecodeEngine in one
process, SmolLM2 on the CPU, NIXL over DRAM): the prefill side samples the first token under
the mask, the decode side's matcher follows that token, and the whole output is the one the
colocated engine gives."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.engine_checks import engine_pair
from workers.config import EngineConfig
from workers.disagg.decode import DecodeEngine
from workers.disagg.prefill import PrefillEngine
from workers.llm import LLM
from workers.protocol import GenerateRequest, RequestOutput, SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    with engine_pair(EngineConfig(num_kv_pages=32, page_size=16)) as pair:
        yield pair


def test_a_constrained_request_is_valid_across_the_handoff(
    engines: tuple[PrefillEngine, DecodeEngine],
) -> None:
    prefill, decode = engines
    params = SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputs(json_schema=SCHEMA)
    )
    ids = prefill.tokenizer.encode("A colour and a count as JSON:")
    req = GenerateRequest(request_id="h", prompt_token_ids=ids, params=params)
    prefill.add_request(req)
    first: RequestOutput | None = None
    t0 = time.monotonic()
    while first is None:
        assert time.monotonic() - t0 < DEADLINE_S, "no first token"
        first = next(iter(prefill.step()), None)
    assert first.kv is not None and first.text.startswith("{")  # the mask held it too
    decode.add_remote(req, first)
    chunks: list[RequestOutput] = []
    while not (chunks and chunks[-1].finished):
        assert time.monotonic() - t0 < DEADLINE_S, "the decode did not finish"
        prefill.poll()
        chunks += decode.poll() + decode.step()
    assert chunks[-1].finish_reason == "stop", chunks[-1].error
    assert decode.stats().num_recomputed == 0
    text = first.text + "".join(c.text for c in chunks)
    value = json.loads(text)
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["count"], int)
    [ref] = LLM(num_kv_pages=32, page_size=16).generate([ids], params)
    assert ref.text == text
