"""Tool-call parsers: a model's free text into its tool calls, in the formats of the families
whose chat templates render tools (the names are vLLM's `--tool-call-parser` values):

    hermes       Hermes, Qwen2.5/3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.1-3.3:      [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    mistral      Mistral:            [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                     (or, v11 tokenizers, [TOOL_CALLS]name[ARGS]{...})

Text that does not hold a well-formed call is plain content, never an error: a model may write
the start of a call and then wander off. `hold_from` tells a stream which tail of the text it may
not send yet, because a call may be starting there.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from router.tools.protocol import new_call_id


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text besides the calls (None when there is none)
    calls: tuple[ParsedCall, ...]


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall:
    """A {"name": ..., <args key>: {...}} object as a call; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {obj!r}")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"tool call arguments are not an object: {args!r}")
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str = "") -> list[Any]:
    """The JSON values written one after another in `text` (whitespace and `separators` between)."""
    decoder, pos, out = json.JSONDecoder(), 0, list[Any]()
    skip = string.whitespace + separators
    while True:
        while pos < len(text) and text[pos] in skip:
            pos += 1
        if pos == len(text):
            return out
        value, pos = decoder.raw_decode(text, pos)
        out.append(value)


class ToolParser:
    name: ClassVar[str]
    marker: ClassVar[str]  # the text that opens the calls

    def parse(self, text: str) -> Parsed:
        start = text.find(self.marker)
        if start < 0:
            return Parsed(text, ())
        try:
            calls = self.calls(text[start + len(self.marker):])
        except (ValueError, KeyError):
            return Parsed(text, ())
        if not calls:
            return Parsed(text, ())
        return Parsed(text[:start].rstrip() or None, tuple(calls))

    def calls(self, tail: str) -> list[ParsedCall]:
        """The calls in the text after the marker; ValueError when malformed."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where a call begins in `text`, or may begin (a part of the marker at its end)."""
        start = text.find(self.marker)
        if start >= 0:
            return start
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:k]):
                return len(text) - k
        return len(text)

    def call_id(self) -> str:
        return new_call_id()


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _body = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def calls(self, tail: str) -> list[ParsedCall]:
        bodies = [a or b for a, b in self._body.findall(self.marker + tail)]
        return [_call(json.loads(body), ("arguments", "parameters")) for body in bodies]


class Llama3JsonParser(ToolParser):
    """Calls only at the start of the answer, as Llama 3's templates ask for them."""

    name = "llama3_json"
    marker = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):]
        elif not body.startswith("{"):
            return Parsed(text, ())
        try:
            calls = [_call(v, ("parameters", "arguments")) for v in _json_values(body, ";")]
        except ValueError:
            return Parsed(text, ())
        return Parsed(None, tuple(calls)) if calls else Parsed(text, ())

    def hold_from(self, text: str) -> int:
        body = text.lstrip()
        opens = body.startswith(("{", self.marker)) or self.marker.startswith(body)
        return 0 if opens else len(text)


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _id_chars = string.ascii_letters + string.digits

    def calls(self, tail: str) -> list[ParsedCall]:
        body = tail.strip()
        if body.startswith("["):
            values = _json_values(body)
            if len(values) != 1 or not isinstance(values[0], list):
                raise ValueError("[TOOL_CALLS] is not followed by one JSON array")
            return [_call(v, ("arguments", "parameters")) for v in values[0]]
        calls = []
        for part in body.split(self.marker):
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                raise ValueError("a [TOOL_CALLS] call without [ARGS]")
            calls.append(_call({"name": name.strip(), "arguments": json.loads(args)},
                               ("arguments",)))
        return calls

    def call_id(self) -> str:
        """Mistral's templates take ids of 9 letters and digits."""
        return "".join(secrets.choice(self._id_chars) for _ in range(9))


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def default_parser(chat_template: str | None, architecture: str | None) -> str:
    """The parser for a model's family: by the tool format its chat template writes, else by its
    architecture; Hermes's format where neither tells (Qwen, Hermes, SmolLM3 use it)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser.name
    if "[TOOL_CALLS]" in template or (architecture or "").startswith(("Mistral", "Mixtral")):
        return MistralParser.name
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return Llama3JsonParser.name
    return HermesParser.name
