"""One OpenAI request in flight: its engine requests (prompts x n), each choice's state, usage.

Choice `i` of prompt `p` has index `p * n + i` and engine request id `<id>-<index>` (just `<id>`
when there is one choice); a seeded request gives choice `i` the seed `seed + i`.
`merge_streams` interleaves the engine streams of all choices and always closes every one of
them, which aborts whatever is still running (client gone, error in another choice).

The n choices of a prompt share its KV pages through the prefix cache, but only pages that are
cached when a choice is admitted: started together, each would compute the whole prompt. So the
first choice of a prompt leads and the others start at its first token, when its prompt pages
are cached (on its prefill replica, or its colocated engine): they compute only the partial
last page, at the cost of one short prefill more before their first token (SGLang likewise
prefills a parallel-sampling prompt once before its n copies).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve.exceptions import BackPressureError

from router.admission import PoolFullError
from router.errors import APIError, BadRequestError
from router.metrics import Metrics, RequestOutcome, RequestTimer
from router.params import sampling_params
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from router.tokenizer import Prompts, RawPrompt
from router.tools.choice import ToolPlan
from workers.api import GenerateRequest, LoRARequest, RequestOutput, TokenLogprob, truncated_prompt


@dataclass
class ChoiceState:
    index: int
    prompt: int
    timer: RequestTimer
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts


@dataclass
class Job:
    id: str
    chat: bool
    model: str
    prompt_ids: list[list[int]]
    requests: list[GenerateRequest]
    choices: list[ChoiceState]
    logprobs: int | None
    echo: list[str] | None = None  # with echo: each prompt's text (chat: the last message's)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field in the response
    include_usage: bool = False
    continuous_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    outcome: RequestOutcome | None = None  # counts the HTTP request's failure, once
    tools: ToolPlan | None = None  # chat with tools: how answers become tool calls
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details, as vLLM's flag
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N"

    def add(self, index: int, out: RequestOutput) -> ChoiceState:
        """Fold one engine chunk into its choice."""
        choice = self.choices[index]
        choice.text += out.text
        choice.num_tokens += len(out.token_ids)
        choice.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        choice.num_cached_tokens = out.num_cached_tokens
        choice.timer.on_tokens(len(out.token_ids))
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            choice.timer.finish(out.finish_reason)
            if out.finish_reason == "error" and self.outcome is not None:
                self.outcome.failed(500)  # the engine failed it: the client is told so
        return choice

    def leaders(self) -> list[int]:
        """For each choice, the choice whose first token starts it: the prompt's first."""
        n = len(self.choices) // len(self.prompt_ids)
        return [c.prompt * n for c in self.choices]

    def close(self, reason: str = "abort", status: int = 500) -> None:
        """End the choices that never finished (client gone: "abort"; a failure: "error",
        answered with HTTP `status`) and count the request's failure."""
        open_choices = [c for c in self.choices if c.finish_reason is None]
        for choice in open_choices:
            choice.finish_reason = reason
            choice.timer.finish(reason)
        if self.outcome is not None and (open_choices or reason == "error"):
            self.outcome.failed(status if reason == "error" else None)

    def usage(self, choices: list[ChoiceState] | None = None) -> Usage:
        choices = self.choices if choices is None else choices
        prompts = sorted({c.prompt for c in choices})
        prompt_tokens = sum(len(self.prompt_ids[p]) for p in prompts)
        cached = sum(max(c.num_cached_tokens for c in choices if c.prompt == p) for p in prompts)
        completion = sum(c.num_tokens for c in choices)
        details = None  # as vLLM: only when enabled and some prompt tokens were cached
        if self.prompt_tokens_details and cached:
            details = PromptTokensDetails(cached_tokens=cached)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion, prompt_tokens_details=details)


def build_job(req: SamplingFields, prompt_ids: list[list[int]], prompts: Prompts, model: str,
              metrics: Metrics, defaults: Mapping[str, float] | None = None,
              tools: ToolPlan | None = None,
              constraints: Mapping[str, Any] | None = None,
              arrival: float | None = None, lora: LoRARequest | None = None) -> Job:
    """The job of one request. `constraints`: the SamplingParams fields of the request's
    constraints (`router.structured.constraint_params`); `tools`: its tool plan, for its
    answers; `arrival`: when it came (`time.monotonic()`, its queue time); `lora`: the
    adapter it runs with (`model`: its name then)."""
    chat = isinstance(req, ChatCompletionRequest)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.truncate_prompt_tokens is not None:
        prompt_ids = [_truncated(ids, req.truncate_prompt_tokens, prompts) for ids in prompt_ids]
    requested = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        requested = req.max_completion_tokens
    requests, choices = [], []
    for p, ids in enumerate(prompt_ids):
        max_tokens = prompts.resolve_max_tokens(len(ids), requested, chat)
        for i in range(req.n):
            index = p * req.n + i
            params = sampling_params(req, max_tokens, seed_offset=i, defaults=defaults,
                                     constraints=constraints)
            name = rid if len(prompt_ids) * req.n == 1 else f"{rid}-{index}"
            requests.append(GenerateRequest(request_id=name, prompt_token_ids=tuple(ids),
                                            params=params, lora=lora,
                                            cache_salt=req.cache_salt,
                                            priority=req.priority))  # fmt: skip
            timer = metrics.request_timer(len(ids), req.n, max_tokens, arrival)
            choices.append(ChoiceState(index=index, prompt=p, timer=timer))
    opts = req.stream_options
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        sent = req.prompt if req.truncate_prompt_tokens is None else prompt_ids
        echo = _prompt_texts(sent, prompt_ids, prompts)
    elif isinstance(req, ChatCompletionRequest) and req.echo:
        echo = [chat_echo(req)]
    return Job(id=rid, chat=chat, model=model, prompt_ids=prompt_ids, requests=requests,
               choices=choices, logprobs=requests[0].params.logprobs, echo=echo,
               prompt_logprobs=req.prompt_logprobs is not None,
               include_usage=bool(opts and opts.include_usage),
               continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
               tools=tools, token_ids_as_text=bool(req.return_tokens_as_token_ids))


def _truncated(ids: list[int], keep: int, prompts: Prompts) -> list[int]:
    """The prompt's last `keep` tokens (`truncate_prompt_tokens`), or 400."""
    try:
        return truncated_prompt(ids, keep, prompts.max_model_len)
    except ValueError as e:
        raise BadRequestError(str(e), param="truncate_prompt_tokens") from e


def _prompt_texts(prompt: RawPrompt, prompt_ids: list[list[int]], prompts: Prompts) -> list[str]:
    """Each prompt's text for echo: as the client sent it, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    return [prompts.decode(ids, skip_special_tokens=False) for ids in prompt_ids]


def chat_echo(req: ChatCompletionRequest) -> str:
    """What chat `echo` puts before the reply, as vLLM does: the last message's content when
    the reply continues its role (always without a generation prompt; else an assistant's)."""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "\n".join(part.text or "" for part in last.content)
    return last.content or ""


def as_api_error(exc: BaseException) -> APIError:
    """What the client is told about a backend failure: rejections are the caller's (400).

    A Ray task error is also an instance of its cause's class; its `cause` has the short message.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackPressureError):  # a pool's `max_queued_requests`: `Admission`'s 429
        return PoolFullError("a worker pool has as many calls queued as its bound")
    if isinstance(exc, ValueError):
        cause = getattr(exc, "cause", None)
        return BadRequestError(str(cause if isinstance(cause, ValueError) else exc))
    return APIError(f"{type(exc).__name__}: {exc}")


_END = object()
Stream = AsyncIterator[RequestOutput]


async def merge_streams(
    streams: list[Stream], leaders: list[int] | None = None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, chunk) from all streams as they come; backend failures as `APIError`.
    Stream i starts with the first chunk (or the end) of stream `leaders[i]`; at once where
    that is i itself, or without `leaders`."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    leaders = list(range(len(streams))) if leaders is None else leaders
    followers: dict[int, list[int]] = {}
    for i, leader in enumerate(leaders):
        if leader != i:
            followers.setdefault(leader, []).append(i)
    tasks: list[asyncio.Future[None]] = []

    def start(i: int) -> None:
        tasks.append(asyncio.ensure_future(pump(i, streams[i])))

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
                for j in followers.pop(i, ()):
                    start(j)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            for j in followers.pop(i, ()):
                start(j)
            queue.put_nowait((i, _END))

    for i, leader in enumerate(leaders):
        if leader == i:
            start(i)
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise as_api_error(item) from item
            else:
                assert isinstance(item, RequestOutput)
                yield i, item
    finally:
        followers.clear()  # a pump that ends now starts no one
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
