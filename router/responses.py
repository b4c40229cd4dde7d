"""A job's state as OpenAI objects: full responses, stream chunks, and logprobs in both shapes.

Completions logprobs name tokens by their text with a `{token: logprob}` map per position: the
sampled token first, then the top ones best first (as vLLM does); chat logprobs are a list per
token with `bytes` and the `top_logprobs` best first. Logprobs are clamped to -9999 so JSON
never meets -inf.
"""

from __future__ import annotations

from router.generation import ChoiceState, Job
from router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from router.tokenizer import Prompts
from router.tools.answer import tool_answer
from workers.api import RequestOutput, TokenLogprob

MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_name(prompts: Prompts, token_id: int, as_id: bool) -> str:
    """How logprobs name a token: its text, or vLLM's "token_id:N" with
    return_tokens_as_token_ids (for tokens that are no text of their own)."""
    return f"token_id:{token_id}" if as_id else prompts.token_text(token_id)


def sampled_then_top(t: TokenLogprob) -> list[tuple[int, float]]:
    """A position's (token id, logprob): the sampled token, then the top ones best first."""
    best = sorted(t.top.items(), key=lambda kv: -kv[1])
    return [(t.token_id, t.logprob), *((i, lp) for i, lp in best if i != t.token_id)]


def completion_logprobs(choice: ChoiceState, tokens: list[TokenLogprob], prompts: Prompts,
                        echo: list[int] | None = None, as_ids: bool = False) -> CompletionLogprobs:
    """Logprobs of `tokens`, the choice's newest, after those of the prompt's tokens `echo`
    when given (the first has none: null, as vLLM answers); advances the choice's text offset."""
    out = CompletionLogprobs()
    entries: list[tuple[int, TokenLogprob | None]] = [(t.token_id, t) for t in tokens]
    if echo is not None:
        entries = [*zip(echo, choice.prompt_logprobs or [None] * len(echo)), *entries]
    for token_id, t in entries:
        text = prompts.token_text(token_id)
        out.text_offset.append(choice.text_offset)
        out.tokens.append(token_name(prompts, token_id, as_ids))
        if t is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for i, lp in sampled_then_top(t):
                top.setdefault(token_name(prompts, i, as_ids), _lp(lp))
            out.token_logprobs.append(_lp(t.logprob))
            out.top_logprobs.append(top)
        choice.text_offset += len(text)
    return out


def chat_logprobs(tokens: list[TokenLogprob], prompts: Prompts, top_n: int,
                  as_ids: bool = False) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = token_name(prompts, token_id, as_ids)
        return TopLogprob(token=text, logprob=_lp(logprob), bytes=list(text.encode()))

    content = []
    for t in tokens:
        best = sorted(t.top.items(), key=lambda kv: -kv[1])[:top_n]
        head = entry(t.token_id, t.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(),
                                        top_logprobs=[entry(i, lp) for i, lp in best]))
    return ChatLogprobs(content=content)


# ---- whole responses --------------------------------------------------------------------------
def completion_response(job: Job, prompts: Prompts) -> CompletionResponse:
    choices = []
    for c in job.choices:
        text = (job.echo[c.prompt] if job.echo else "") + c.text
        echo = job.prompt_ids[c.prompt] if job.echo else None
        logprobs = (None if job.logprobs is None else
                    completion_logprobs(c, c.logprobs, prompts, echo, job.token_ids_as_text))
        choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                        finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason,
                                        prompt_logprobs=vllm_prompt_logprobs(job, c, prompts)))
    return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                              usage=job.usage())


def chat_response(job: Job, prompts: Prompts) -> ChatCompletionResponse:
    choices = []
    for c in job.choices:
        logprobs = None
        if job.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, prompts, job.logprobs, job.token_ids_as_text)
        message, finish = AssistantMessage(content=chat_text(job, c)), c.finish_reason
        if job.tools is not None and job.tools.parses:
            content, calls, finish = tool_answer(job.tools, c.text, c.finish_reason)
            message = AssistantMessage(content=content, tool_calls=calls)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                  finish_reason=finish, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model,
                                  choices=choices, usage=job.usage(),
                                  prompt_logprobs=vllm_prompt_logprobs(job, job.choices[0],
                                                                       prompts))


def chat_text(job: Job, choice: ChoiceState) -> str:
    """A chat choice's reply, after the last message's content with echo."""
    return (job.echo[0] if job.echo else "") + choice.text


def vllm_prompt_logprobs(job: Job, choice: ChoiceState, prompts: Prompts) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its own entry and the
    top ones, keyed by token id, each with its rank (1 = most likely) and text."""
    if not job.prompt_logprobs or choice.prompt_logprobs is None:
        return None
    out: PromptLogprobs = []
    for t in choice.prompt_logprobs:
        if t is None:
            out.append(None)
            continue
        ranked = [(i, lp, r) for r, (i, lp) in enumerate(t.top.items(), start=1)]
        out.append({str(i): PromptLogprob(logprob=_lp(lp), rank=r,
                                          decoded_token=prompts.token_text(i))
                    for i, lp, r in [*ranked, (t.token_id, t.logprob, t.rank)]})
    return out


# ---- stream chunks ----------------------------------------------------------------------------
Chunk = ChatCompletionChunk | CompletionChunk


def role_chunks(job: Job) -> list[ChatCompletionChunk]:
    """The first chat chunks, one per choice (as vLLM sends them): `delta.role`, no content;
    with continuous usage stats, the usage so far (the prompt's) as on every chunk."""
    return [ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[
        ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))],
        usage=job.usage([c]) if job.continuous_usage else None) for c in job.choices]


def content_chunk(job: Job, choice: ChoiceState, out: RequestOutput, first: bool,
                  prompts: Prompts) -> Chunk | None:
    """The chunk for one engine output of `choice`; None when it carries nothing to send. As
    in vLLM, a new token is a chunk even when it adds no text yet (part of a character, text
    held back for a stop string): clients time tokens (TTFT, ITL) by chunks."""
    text = out.text
    if first and job.echo:
        text = job.echo[choice.prompt] + text
    if not text and not out.finished and not out.logprobs and not out.token_ids:
        return None
    finish = choice.finish_reason if out.finished else None
    stop = choice.stop_reason if out.finished else None
    usage = job.usage([choice]) if job.continuous_usage else None
    tokens = out.logprobs or []
    if job.chat:
        lp = (chat_logprobs(tokens, prompts, job.logprobs, job.token_ids_as_text)
              if job.logprobs is not None else None)
        delta = ChatStreamChoice(index=choice.index, delta=DeltaMessage(content=text),
                                 logprobs=lp, finish_reason=finish, stop_reason=stop)
        return ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                                   choices=[delta], usage=usage)
    echo = job.prompt_ids[choice.prompt] if first and job.echo else None
    clp = (completion_logprobs(choice, tokens, prompts, echo, job.token_ids_as_text)
           if job.logprobs is not None else None)
    item = CompletionChoice(index=choice.index, text=text, logprobs=clp, finish_reason=finish,
                            stop_reason=stop)
    return CompletionChunk(id=job.id, created=job.created, model=job.model, choices=[item],
                           usage=usage)


def usage_chunk(job: Job) -> Chunk:
    """The last chunk with `include_usage`: no choices, the whole request's usage."""
    cls = ChatCompletionChunk if job.chat else CompletionChunk
    return cls(id=job.id, created=job.created, model=job.model, choices=[], usage=job.usage())
