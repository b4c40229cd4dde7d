"""Structured outputs and tool calls through real Ray Serve and HTTP, SmolLM2 on CPU, in both
modes (the shared configs/local.yaml applications): the openai client's `parse` gets an object for
each of 20 pydantic schemas; tool_choice required and named give calls that parse, streamed as
not; `auto` and a follow-up turn with the tool's result. Both modes' requests go at once (each
application's engine computes on a core of its own), a request's streamed and whole forms too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.e2e.conftest import MODES
from tests.e2e.pydantic_schemas import SCHEMAS

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def apps(local_apps: dict[str, str]) -> dict[str, str]:
    """Base URL of each mode's configs/local.yaml application."""
    return local_apps


def openai_client(base: str) -> AsyncOpenAI:
    # A request beyond the router's queue bound would get 429 + Retry-After: the client retries.
    # Generous timeout: a timed-out request would be retried, adding load (2 CPUs, both modes).
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=30, timeout=600)


def test_parse_gives_an_object_for_each_of_20_pydantic_schemas(apps) -> None:
    async def one(c: AsyncOpenAI, model: type[BaseModel], prompt: str) -> object:
        r = await c.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=model,
            temperature=0, max_tokens=150)
        return r.choices[0].message.parsed

    async def run_all() -> list[object]:
        clients = [openai_client(apps[mode]) for mode in MODES]
        return await asyncio.gather(*(one(c, m, p) for c in clients for m, p in SCHEMAS),
                                    return_exceptions=True)

    results = asyncio.run(run_all())
    asked = [(mode, m) for mode in MODES for m, _ in SCHEMAS]
    wrong = [(mode, m.__name__, r) for (mode, m), r in zip(asked, results, strict=True)
             if not isinstance(r, m)]  # fmt: skip
    assert not wrong, wrong


WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 24}}}}},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_BODY = {"model": MODEL, "messages": ASK_WEATHER, "tools": WEATHER_TOOLS, "temperature": 0,
             "max_tokens": 80}


async def answer_both_ways(c: AsyncOpenAI, body: dict[str, Any]) -> tuple[Any, Any]:
    """The non-streamed choice, and the streamed one as (content, [(name, arguments)], finish)."""
    async def streamed() -> tuple[str, list[tuple[str, str]], str | None]:
        content, names, args, finish = "", {}, {}, None
        async for chunk in await c.chat.completions.create(**body, stream=True):
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        return content, [(names[i], args[i]) for i in sorted(names)], finish

    whole, stream = await asyncio.gather(c.chat.completions.create(**body), streamed())
    return whole.choices[0], stream


def calls_of(choice: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_required_and_named_tool_choice_give_parsable_calls_streamed_or_not(apps) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}

    async def run_all() -> list[tuple[Any, Any]]:
        clients = [openai_client(apps[mode]) for mode in MODES]
        return await asyncio.gather(*(answer_both_ways(c, {**TOOL_BODY, "tool_choice": choice})
                                      for c in clients for choice in ("required", named)))

    answers = asyncio.run(run_all())
    for i, mode in enumerate(MODES):
        (required, required_stream), (by_name, by_name_stream) = answers[2 * i : 2 * i + 2]
        for choice, streamed in ((required, required_stream), (by_name, by_name_stream)):
            calls = calls_of(choice)
            assert calls and choice.finish_reason == "tool_calls", (mode, choice)
            assert all(name in ("get_weather", "get_time") and isinstance(json.loads(args), dict)
                       for name, args in calls), mode
            assert all(c.id and c.type == "function" for c in choice.message.tool_calls)
            assert streamed == ((choice.message.content or ""), calls, "tool_calls"), mode
        assert [name for name, _ in calls_of(by_name)] == ["get_time"], mode


# SmolLM2's template has no place for tools; an earlier turn in the Hermes format shows it how.
SHOWN_HOW = [
    {"role": "user", "content": "Call get_weather for Rome."},
    {"role": "assistant",
     "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'},
    {"role": "user", "content": "Call get_weather for Paris."},
]


def test_auto_finds_the_models_call_and_a_follow_up_turn_answers(apps) -> None:
    async def turns(mode: str) -> list[tuple[Any, Any]]:
        c = openai_client(apps[mode])
        auto = await answer_both_ways(c, {**TOOL_BODY, "messages": SHOWN_HOW})
        call = auto[0].message.tool_calls[0]
        follow_up = [*SHOWN_HOW, auto[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
        return [auto, await answer_both_ways(c, {**TOOL_BODY, "messages": follow_up})]

    async def run_all() -> list[list[tuple[Any, Any]]]:
        return await asyncio.gather(*(turns(mode) for mode in MODES))

    for mode, ((auto, auto_stream), (after, after_stream)) in zip(MODES, asyncio.run(run_all())):
        assert calls_of(auto) == [("get_weather", '{"city": "Paris"}')], mode
        assert auto.finish_reason == "tool_calls" and auto.message.content is None, mode
        assert auto_stream == ("", calls_of(auto), "tool_calls"), mode
        assert after.finish_reason in ("stop", "tool_calls", "length"), mode
        assert (after.message.content or calls_of(after)), mode
        assert after_stream == (after.message.content or "", calls_of(after),
                                after.finish_reason), mode
