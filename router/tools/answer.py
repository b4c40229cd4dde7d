"""A choice's text as an answer under a tool plan: its message (content and `tool_calls`) and
finish reason. A call ends the answer as OpenAI says: `finish_reason` "tool_calls" where the
model stopped by itself (cut off by max_tokens it stays "length")."""

from __future__ import annotations

from router.tools.choice import ToolPlan
from router.tools.parsers import ParsedCall
from router.tools.protocol import FunctionCall, ToolCall


def tool_calls(plan: ToolPlan, calls: tuple[ParsedCall, ...]) -> list[ToolCall]:
    return [ToolCall(id=plan.parser.call_id(),
                     function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def tool_answer(plan: ToolPlan, text: str, reason: str | None
                ) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish reason) of a whole answer."""
    parsed = plan.answer(text)
    return parsed.content, tool_calls(plan, parsed.calls), finish_reason(reason, bool(parsed.calls))
