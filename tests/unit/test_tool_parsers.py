"""Tool-call parsers, tool plans and the streaming of calls, on text alone (no model)."""

from __future__ import annotations

import json

import pytest

from router.errors import BadRequestError
from router.tools.choice import plan_tools, required_calls, required_schema
from router.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Parsed,
    ParsedCall,
    default_parser,
)
from router.tools.protocol import NamedToolChoice, Tool
from router.tools.stream import ToolStream

WEATHER = {"city": "Paris", "unit": "celsius"}
ARGS = json.dumps(WEATHER)
TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": n, "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}}) for n in ("get_weather", "get_time")]


def call(name: str = "get_weather", args: str = ARGS) -> ParsedCall:
    return ParsedCall(name, args)


@pytest.mark.parametrize("text,expected", [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
     Parsed(None, (call(),))),
    (f'Let me look.\n<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'
     f'<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>',
     Parsed("Let me look.", (call(), call("get_time", "{}")))),
    (f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}',  # cut before the close tag
     Parsed(None, (call(),))),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', None),  # malformed
    ('<tool_call>["not", "a call"]</tool_call>', None),
    ("Just an answer, no call.", None),
])
def test_hermes(text: str, expected: Parsed | None) -> None:
    assert HermesParser().parse(text) == (expected or Parsed(text, ()))


@pytest.mark.parametrize("text,expected", [
    (f'{{"name": "get_weather", "parameters": {ARGS}}}', Parsed(None, (call(),))),
    (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; '
     '{"name": "get_time", "parameters": {}}',
     Parsed(None, (call(), call("get_time", "{}")))),
    (f' {{"name": "get_weather", "arguments": "{ARGS.replace(chr(34), chr(92) + chr(34))}"}}',
     Parsed(None, (call(),))),  # arguments as JSON text
    ('{"name": "get_weather", "parameters": ', None),
    ('{"answer": 42}', None),
    (f'The call is {{"name": "get_weather", "parameters": {ARGS}}}', None),  # only at the start
])
def test_llama3_json(text: str, expected: Parsed | None) -> None:
    assert Llama3JsonParser().parse(text) == (expected or Parsed(text, ()))


@pytest.mark.parametrize("text,expected", [
    (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]', Parsed(None, (call(),))),
    (f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
     '{"name": "get_time", "arguments": {}}]',
     Parsed("Sure.", (call(), call("get_time", "{}")))),
    (f"[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]get_time[ARGS]{{}}",
     Parsed(None, (call(), call("get_time", "{}")))),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {', None),
    ("[TOOL_CALLS]get_weather", None),
])
def test_mistral(text: str, expected: Parsed | None) -> None:
    assert MistralParser().parse(text) == (expected or Parsed(text, ()))


def test_mistral_ids_are_nine_letters_and_digits_others_vllms() -> None:
    mistral = MistralParser().call_id()
    assert len(mistral) == 9 and mistral.isalnum()
    assert HermesParser().call_id().startswith("chatcmpl-tool-")


@pytest.mark.parametrize("template,arch,name", [
    ("{% if tools %}<tool_call>{% endif %}", "Qwen2ForCausalLM", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "LlamaForCausalLM",
     "llama3_json"),
    ("[INST]{{ m }}[/INST][TOOL_CALLS]", "MistralForCausalLM", "mistral"),
    ("[INST]{{ m }}[/INST]", "MistralForCausalLM", "mistral"),
    ("<|im_start|>{{ m }}<|im_end|>", "LlamaForCausalLM", "hermes"),  # SmolLM2: no tool format
    (None, None, "hermes"),
])
def test_default_parser_by_family(template: str | None, arch: str | None, name: str) -> None:
    assert default_parser(template, arch) == name


def test_plans_and_their_400s() -> None:
    assert plan_tools(None, None, "hermes") is None
    assert plan_tools(None, "none", "hermes") is None
    for choice in ("auto", "required", NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "get_weather"}})):
        with pytest.raises(BadRequestError, match="tool_choice needs tools"):
            plan_tools(None, choice, "hermes")
    with pytest.raises(BadRequestError, match="not in tools") as e:
        plan_tools(TOOLS, NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "launch"}}), "hermes")
    assert e.value.param == "tool_choice"
    plan = plan_tools(TOOLS, None, "hermes")
    assert plan is not None and plan.choice == "auto" and plan.schema is None
    assert [t["function"]["name"] for t in plan.tools] == ["get_weather", "get_time"]
    none = plan_tools(TOOLS, "none", "hermes")
    assert none is not None and not none.parses and none.tools  # rendered, not parsed (vLLM)
    named = plan_tools(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_time"}}), "mistral")
    assert named is not None and named.schema == TOOLS[1].function.parameters
    assert named.answer('{"city": "Oslo"}') == Parsed(None, (call("get_time", '{"city": "Oslo"}'),))


def test_required_schema_moves_defs_up_and_its_answers_parse() -> None:
    import jsonschema
    with_defs = Tool.model_validate({"function": {"name": "book", "parameters": {
        "type": "object", "properties": {"room": {"$ref": "#/$defs/Room"}},
        "$defs": {"Room": {"type": "string", "enum": ["a", "b"]}}}}})
    schema = required_schema([*TOOLS, with_defs])
    assert schema["$defs"] == {"Room": {"type": "string", "enum": ["a", "b"]}}
    good = [{"name": "book", "parameters": {"room": "a"}},
            {"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "book", "parameters": {"room": "c"}}],
                [{"name": "launch", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_calls(json.dumps(good)).calls == (
        call("book", '{"room": "a"}'), call("get_weather", '{"city": "Paris"}'))
    assert required_calls('[{"name": "book", "param') == Parsed('[{"name": "book", "param', ())
    clash = Tool.model_validate({"function": {"name": "x", "parameters": {
        "$defs": {"Room": {"type": "integer"}}}}})
    with pytest.raises(BadRequestError, match="Room"):
        required_schema([with_defs, clash])


def stream_all(choice: str | NamedToolChoice, pieces: list[str]) -> tuple[str, list[dict]]:
    plan = plan_tools(TOOLS, choice, "hermes")
    assert plan is not None
    stream = ToolStream(plan)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = stream.feed(piece, i == len(pieces) - 1)
        content += text
        deltas += [d.model_dump(exclude_none=True) for d in calls]
    return content, deltas


def merged_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """The calls a client builds from deltas: by index, name once, arguments concatenated."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], ["", ""])
        entry[0] += d.get("function", {}).get("name", "")
        entry[1] += d.get("function", {}).get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("text", [
    f'Let me check.  \n<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>',
    "Plain <tool text that only looks like a call <tool_ and ends here",
    '<tool_call>{"name": "get_weather", "arguments": {"city"',
    f'<tool_call>{{"name": "get_time", "arguments": {ARGS}}}</tool_call>',
])
def test_auto_stream_agrees_with_the_whole_answer_for_any_split(text: str) -> None:
    whole = HermesParser().parse(text)
    for size in (1, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)] + [""]
        content, deltas = stream_all("auto", pieces)
        assert content == (whole.content or "")
        assert merged_calls(deltas) == [(c.name, c.arguments) for c in whole.calls]
        assert all("id" in d and d["type"] == "function" for d in deltas)


def test_content_before_a_call_streams_before_the_call_ends() -> None:
    plan = plan_tools(TOOLS, "auto", "hermes")
    assert plan is not None
    stream = ToolStream(plan)
    assert stream.feed("Checking the ", False) == ("Checking the", [])
    assert stream.feed("weather <tool", False) == (" weather", [])
    assert stream.feed('_call>{"name"', False) == ("", [])


def test_named_streams_arguments_as_generated_and_required_whole() -> None:
    named = NamedToolChoice.model_validate({"function": {"name": "get_weather"}})
    content, deltas = stream_all(named, ['{"city"', ': "Paris"}', ""])
    assert content == "" and deltas[0]["function"] == {"name": "get_weather",
                                                       "arguments": '{"city"'}
    assert merged_calls(deltas) == [("get_weather", '{"city": "Paris"}')]
    assert "id" not in deltas[1]
    text = json.dumps([{"name": "get_time", "parameters": {"city": "Oslo"}}])
    content, deltas = stream_all("required", [text[:5], text[5:]])
    assert content == "" and merged_calls(deltas) == [("get_time", '{"city": "Oslo"}')]
