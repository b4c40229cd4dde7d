"""Earlier tool turns of a conversation as chat templates take them: an assistant message's
`tool_calls` with their arguments as objects (templates write them with `tojson`; vLLM hands
them over so), a tool message's `tool_call_id`."""

from __future__ import annotations

import json
from typing import Any

from router.errors import BadRequestError
from router.tools.protocol import ToolCall


def template_tool_fields(extra: dict[str, Any], index: int) -> dict[str, Any]:
    """The tool fields of message `index` (its extra fields) for the template."""
    out: dict[str, Any] = {}
    if extra.get("tool_call_id") is not None:
        out["tool_call_id"] = str(extra["tool_call_id"])
    if extra.get("tool_calls"):
        param = f"messages.{index}.tool_calls"
        try:
            calls = [ToolCall.model_validate(c) for c in extra["tool_calls"]]
            out["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments or "{}")}}
                for c in calls]
        except (ValueError, TypeError) as e:  # pydantic's errors are ValueErrors
            raise BadRequestError(f"{param}: not tool calls with JSON arguments: {e}",
                                  param=param) from e
    return out
