"""Server-sent events for a streaming job, in the order vLLM and OpenAI send them.

    data: <chat role chunk> ...        chat only: delta.role = "assistant", one per choice
    data: <content chunk> ...          the last one of each choice carries finish_reason
    data: <usage chunk>                with stream_options.include_usage: choices [] + usage
    data: [DONE]

A failure after the 200 went out is sent as `data: {"error": {...}}` followed by `[DONE]`.
Whatever ends the stream (the last chunk, an error, the client going away), the merged engine
streams are closed in `finally`, which aborts every request still running.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator

from pydantic import BaseModel

from router.errors import APIError, error_info
from router.generation import Job
from router.protocol import ErrorResponse
from router.responses import content_chunk, role_chunks, usage_chunk
from router.tokenizer import Prompts
from router.tools.stream import ToolStream, tool_chunk
from workers.api import RequestOutput

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: BaseModel) -> str:
    """One event; a chunk's `usage` appears only when it is set."""
    exclude = {"usage"} if getattr(obj, "usage", 1) is None else None
    return f"data: {obj.model_dump_json(exclude=exclude)}\n\n"


def error_event(exc: APIError) -> str:
    return sse(ErrorResponse(error=exc.info()))


async def stream_events(job: Job, first: tuple[int, RequestOutput],
                        rest: AsyncGenerator[tuple[int, RequestOutput], None],
                        prompts: Prompts) -> AsyncIterator[str]:
    """The job's SSE events; `first` is the chunk already taken from `rest` before the 200."""
    started: set[int] = set()
    tools = ({c.index: ToolStream(job.tools) for c in job.choices}
             if job.tools is not None and job.tools.parses else None)
    try:
        for role in role_chunks(job) if job.chat else []:
            yield sse(role)
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, out = item
            choice = job.add(index, out)
            if out.finish_reason == "error":
                yield error_event(APIError(out.error or "generation failed"))
                break
            chunk = (content_chunk(job, choice, out, index not in started, prompts)
                     if tools is None else tool_chunk(job, choice, out, tools[index], prompts))
            if chunk is not None:
                started.add(index)
                yield sse(chunk)
            item = await anext(rest, None)
        else:
            if job.include_usage:
                yield sse(usage_chunk(job))
    except APIError as e:
        job.close("error", e.status)
        yield error_event(e)
    except Exception as e:  # noqa: BLE001 - the 200 is gone; tell the client in the stream
        logger.exception("stream %s failed", job.id)
        job.close("error")
        yield sse(ErrorResponse(error=error_info(500, f"{type(e).__name__}: {e}")))
    finally:
        job.close("abort")  # the client went away before the end
        await rest.aclose()
    yield DONE
