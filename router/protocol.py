"""The OpenAI API's objects as vLLM serves them: requests, responses, stream chunks, errors.

Requests accept unknown fields (benchmarks send `best_of`, `logprobs: null`, ...) and keep them in
`model_extra`, where `router.params.check_supported` rejects the ones that would change the
output. Field bounds live here, so a bad value fails FastAPI's validation and becomes a 400 in
`router.errors`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from router.structured_fields import StructuredFields
from router.tools.protocol import DeltaToolCall, Tool, ToolCall, ToolChoice
from workers.api import MAX_LOGPROBS


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests ---------------------------------------------------------------------------------
class RequestBody(BaseModel):
    """What every request shares: unknown fields kept, numbers finite (JSON parsers take
    `Infinity` and `NaN`), text that is Unicode (JSON can escape a lone surrogate, which no
    tokenizer encodes)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = _lone_surrogate(data, ())
        if where is not None:
            path, char = where
            raise ValueError(
                f"{'.'.join(path) or 'the body'} holds a lone surrogate (U+{ord(char):04X}), "
                "which is not Unicode text: send text as valid UTF-8"
            )
        return data


def _lone_surrogate(value: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], str] | None:
    """The path to the first string in `value` with a lone surrogate, and that character."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, value[e.start]
        return None
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        found = _lone_surrogate(key, path) or _lone_surrogate(item, (*path, str(key)))
        if found is not None:
            return found
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestBody, StructuredFields):
    """The fields that completions and chat share (constraints: `StructuredFields`); unknown
    ones are kept in `model_extra`."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM: torch.long's range
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: the prompt's last k tokens
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix cache shared per salt
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)  # vLLM's: lower first (priority policy)
    user: str | None = None

    @field_validator("n", "stream", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                     "skip_special_tokens", "logprobs", "echo", "add_generation_prompt",
                     "continue_final_message", "priority", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """`"n": null` and friends mean "the default", as clients and benchmarks send them."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


# OpenAI's roles. vLLM passes any other role to the chat template, which renders it as text the
# model never saw in training; a typo (`"role": "usr"`) then answers garbage instead of a 400.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # accepted; the model decides, as in vLLM
    echo: bool = False  # vLLM's: the reply starts with the last message's content


class TokenizeRequest(RequestBody):
    """vLLM's two bodies in one: `prompt` (with `add_special_tokens`), or `messages` through the
    chat template (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
    `tools`, as chat completions render them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


def _now() -> int:
    return int(time.time())


class PromptLogprob(OpenAIModel):
    """vLLM's entry for one token of a prompt position: its logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; token id -> entry


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class OpenAIObject(OpenAIModel):
    """What every response and chunk carries besides its choices: OpenAI's `service_tier` and
    `system_fingerprint`, `null` as vLLM sends them (one tier, no fingerprint)."""

    id: str
    created: int = Field(default_factory=_now)
    model: str
    service_tier: ServiceTier | None = None
    system_fingerprint: str | None = None


class CompletionResponse(OpenAIObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # of the (one) prompt, as vLLM puts it here


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(OpenAIObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(OpenAIObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pdserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the tokenizer's pieces


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
