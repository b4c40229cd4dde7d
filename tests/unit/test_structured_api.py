"""Structured outputs and tool calling through the OpenAI app, the engine replaced by a script:
which constraint reaches `SamplingParams`, the 400s, and the answers' shapes (tool_calls, stream
deltas), streamed and not. That the engine keeps to a constraint is the grammar's tests' job."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from router.openai_api import build_openai_app
from tests.unit.conftest import MODEL, http
from workers.api import GenerateRequest, RequestOutput, StructuredOutputs
from workers.model.files import load_tokenizer

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} of a city",
                                          "parameters": PARAMS}}
         for n in ("get_weather", "get_time")]
# A chat template that renders tools and tool turns (SmolLM2's own ignores them).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %}ID:{{ m.tool_call_id }}{% endif %}\n{% endfor %}"
    "<assistant>"
)


class Scripted:
    """A backend that answers every request with `reply`, a few characters a chunk."""

    def __init__(self) -> None:
        self.reply = "Hello."
        self.seen: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.seen.append(req)
        pieces = [self.reply[i:i + 5] for i in range(0, len(self.reply), 5)] or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id=req.request_id, token_ids=[1], text=piece,
                                finish_reason="stop" if last else None)

    async def stats(self) -> list[Any]:
        return []


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    tok = copy.deepcopy(load_tokenizer(smollm2_dir))
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.fixture
def backend() -> Scripted:
    return Scripted()


@pytest.fixture
def app(backend: Scripted, tokenizer: Any) -> Any:
    return build_openai_app(backend, tokenizer, MODEL, 2048)


def client(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="EMPTY", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))


async def spec_of(app: Any, backend: Scripted, body: dict[str, Any],
                  path: str = "/v1/chat/completions") -> StructuredOutputs | None:
    async with http(app) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    return backend.seen[-1].params.structured_outputs


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


async def test_every_constraint_field_reaches_sampling_params(app, backend) -> None:
    as_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                        "strict": True}}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"response_format": as_schema}, {"json_schema": json.dumps(SCHEMA)}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_regex": r"\d{3}"}, {"regex": r"\d{3}"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ("yes", "no")}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ]
    for fields, expected in cases:
        for path, body in (("/v1/chat/completions", CHAT),
                           ("/v1/completions", {"model": MODEL, "prompt": "Hi"})):
            spec = await spec_of(app, backend, {**body, **fields}, path)
            assert spec == StructuredOutputs(**expected), (path, fields)
    assert await spec_of(app, backend, {**CHAT, "response_format": {"type": "text"}}) is None
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "allowed_token_ids": [5, 7]})
    assert r.status_code == 200 and backend.seen[-1].params.allowed_token_ids == (5, 7)


NAMED = {"type": "function", "function": {"name": "get_time"}}
BAD = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": SCHEMA}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integr"}}}},
     "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "  "}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
async def test_bad_constraints_are_400_naming_the_field(app, fields, param) -> None:
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["message"], err


async def test_invalid_schema_message_names_the_problem(app) -> None:
    bad = {"type": "object", "properties": {"n": {"type": "integr"}}}
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "guided_json": bad})
    assert "invalid JSON schema" in r.json()["error"]["message"]
    assert "integr" in r.json()["error"]["message"]


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]


async def test_parse_sends_the_pydantic_schema_and_parses_the_answer(app, backend) -> None:
    backend.reply = '{"name": "Ada", "age": 36, "role": "admin"}'
    r = await client(app).chat.completions.parse(model=MODEL, messages=CHAT["messages"],
                                                 response_format=Person)
    assert r.choices[0].message.parsed == Person(name="Ada", age=36, role="admin")
    spec = backend.seen[-1].params.structured_outputs
    assert spec is not None and spec.json_schema is not None
    assert json.loads(spec.json_schema)["properties"]["role"]["enum"] == ["admin", "user"]


def tool_cases() -> list[tuple[Any, str, list[tuple[str, dict[str, Any]]], str | None]]:
    """(tool_choice, the model's text, the calls expected, the content expected)."""
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    return [
        ("required", json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                                 {"name": "get_time", "parameters": {"city": "Oslo"}}]),
         [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})], None),
        (NAMED, '{"city": "Rome"}', [("get_time", {"city": "Rome"})], None),
        ("auto", f"I will look it up.\n<tool_call>\n{json.dumps(weather)}\n</tool_call>",
         [("get_weather", {"city": "Paris"})], "I will look it up."),
        (None, f"<tool_call>{json.dumps(weather)}</tool_call>",
         [("get_weather", {"city": "Paris"})], None),
        ("auto", "It is sunny in Paris.", [], "It is sunny in Paris."),
        ("auto", '<tool_call>{"name": "get_weather", "argu', [],
         '<tool_call>{"name": "get_weather", "argu'),
        ("none", f"<tool_call>{json.dumps(weather)}</tool_call>", [],
         f"<tool_call>{json.dumps(weather)}</tool_call>"),
    ]


@pytest.mark.parametrize("choice,text,calls,content", tool_cases())
async def test_tool_calls_streamed_and_not_agree(app, backend, choice, text, calls,
                                                 content) -> None:
    backend.reply = text
    oc = client(app)
    extra = {} if choice is None else {"tool_choice": choice}
    r = await oc.chat.completions.create(**CHAT, tools=TOOLS, **extra)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert got == calls and msg.content == content
    assert finish == ("tool_calls" if calls else "stop")
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-")
               for c in msg.tool_calls or [])
    schema = backend.seen[-1].params.structured_outputs
    assert (schema is not None) == (choice == "required" or choice == NAMED)

    chunks = [c async for c in await oc.chat.completions.create(**CHAT, tools=TOOLS, **extra,
                                                                stream=True)]
    streamed, args, names, ids = "", {}, {}, {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        streamed += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id:  # the first delta of a call: id, type and name
                assert d.index not in ids and d.type == "function" and d.function.name
                ids[d.index], names[d.index] = d.id, d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert streamed == (content or "")
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls
    assert chunks[-1].choices[0].finish_reason == finish


async def test_a_follow_up_turn_renders_the_calls_and_the_results(app, backend,
                                                                   tokenizer) -> None:
    backend.reply = "It is 21 C in Paris."
    messages = [
        *CHAT["messages"],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    r = await client(app).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is 21 C in Paris."
    assert r.choices[0].message.tool_calls in (None, [])
    prompt = tokenizer.decode(backend.seen[-1].prompt_token_ids)
    assert 'CALL:get_weather{"city": "Paris"}' in prompt  # arguments as an object
    assert '<tool>{"celsius": 21}ID:call_1' in prompt and '"name": "get_time"' in prompt
    async with http(app) as c:
        bad = {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}
        r2 = await c.post("/v1/chat/completions", json=bad)
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "messages.0.tool_calls"


async def test_tokenize_renders_tools_as_the_chat_does(app, backend) -> None:
    """/tokenize with `tools` counts the prompt the chat runs (vLLM's TokenizeChatRequest)."""
    async with http(app) as c:
        plain = (await c.post("/tokenize", json=CHAT)).json()
        tools = (await c.post("/tokenize", json={**CHAT, "tools": TOOLS})).json()
        r = await c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert tools["count"] > plain["count"]
    assert tuple(tools["tokens"]) == backend.seen[-1].prompt_token_ids
