"""A chat request's `tools` and `tool_choice` as a plan: what the chat template is given, which
constraint the grammar enforces, and how the answer's text becomes tool calls.

    none      tools rendered (vLLM's default) but the answer is never parsed
    auto      the model may call: the family's parser finds calls in the free text
    required  constrained to a JSON array of >= 1 {"name": <a tool>, "parameters": <its schema>}
    named     constrained to that function's parameters schema: the answer is its arguments
With the grammar enforcing `required` and named, their calls always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from router.errors import BadRequestError
from router.tools.parsers import PARSERS, Parsed, ParsedCall, ToolParser
from router.tools.protocol import NamedToolChoice, Tool, ToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    choice: Literal["none", "auto", "required", "named"]
    tools: list[dict[str, Any]]  # as chat templates take them
    parser: ToolParser  # parses `auto` answers; every mode's call ids
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # the constraint of `required` and named

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def answer(self, text: str) -> Parsed:
        """The content and calls of a whole answer."""
        if self.choice == "named":
            assert self.name is not None
            return Parsed(None, (ParsedCall(self.name, text),))
        if self.choice == "required":
            return required_calls(text)
        if self.choice == "auto":
            return self.parser.parse(text)
        return Parsed(text, ())

    def hold_from(self, text: str) -> int:
        """Where a stream must stop sending `text` as content (a call may begin there)."""
        if self.choice == "auto":
            return self.parser.hold_from(text)
        return 0 if self.choice == "required" else len(text)


def plan_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               parser_name: str) -> ToolPlan | None:
    """The request's plan; None when it offers no tools. 400 for a choice that cannot be met."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise BadRequestError("tool_choice needs tools: set tools", param="tool_choice")
        return None
    parser = PARSERS[parser_name]()
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        found = [t for t in tools if t.function.name == name]
        if not found:
            raise BadRequestError(f"tool_choice names {name!r}, which is not in tools",
                                  param="tool_choice")
        return ToolPlan("named", rendered, parser, name, _parameters(found[0]))
    if tool_choice == "required":
        return ToolPlan("required", rendered, parser, schema=required_schema(tools))
    return ToolPlan(tool_choice or "auto", rendered, parser)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def required_schema(tools: list[Tool]) -> dict[str, Any]:
    """A JSON array of at least one call of the tools (as vLLM builds it); each tool's `$defs`
    move to the top, where their `#/$defs/...` references point once nested."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = dict(_parameters(tool))
        for key, value in params.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise BadRequestError(f"tools define $defs {key!r} differently; required "
                                      "tool_choice needs them to agree", param="tools")
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def required_calls(text: str) -> Parsed:
    """The calls of a `required` answer, a JSON array of {name, parameters}; content when the
    text is not one (cut off by max_tokens)."""
    try:
        items = json.loads(text)
        calls = tuple(ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                      for item in items)
    except (ValueError, TypeError, KeyError):
        return Parsed(text, ())
    return Parsed(None, calls) if calls else Parsed(text, ())
