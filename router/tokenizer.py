"""Prompts into token ids: completion prompts, chat messages through the chat template, limits.

`Prompts` resolves `max_tokens` the way vLLM does (completions 16; chat `max_completion_tokens`
or `max_tokens`, else what is left of the context) and answers an over-long request with 400 and
vLLM's "maximum context length" wording, which client libraries match on.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from router.errors import BadRequestError
from router.protocol import ChatMessage
from router.tools.history import template_tool_fields

COMPLETION_DEFAULT_MAX_TOKENS = 16

TokenIds = list[int]
RawPrompt = str | list[str] | list[int] | list[list[int]]


class Prompts:
    """Tokenizes prompts for one served model; `tokenizer` is a transformers tokenizer."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    # ---- completions ----------------------------------------------------------------------
    def completion_prompts(self, prompt: RawPrompt) -> list[TokenIds]:
        """One token-id list per prompt: a string, strings, token ids, or lists of token ids."""
        batch: list[Any]
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise BadRequestError("prompt is empty", param="prompt")
        return [self._one_prompt(p) for p in batch]

    def _one_prompt(self, prompt: str | list[int]) -> TokenIds:
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise BadRequestError("prompt is empty: at least one token is needed", param="prompt")
        if min(ids) < 0:
            raise BadRequestError("prompt token ids must be non-negative", param="prompt")
        if max(ids) >= self.vocab_size:  # as vLLM; echo would decode it before the engine sees it
            raise BadRequestError(f"Token id {max(ids)} is out of vocabulary", param="prompt")
        return ids

    # ---- chat -----------------------------------------------------------------------------
    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> TokenIds:
        """The conversation through the model's chat template, `tools` (OpenAI's tool objects)
        rendered by it too."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError("this model's tokenizer has no chat template", param="messages")
        if add_generation_prompt and continue_final_message:
            raise BadRequestError("continue_final_message and add_generation_prompt are "
                                  "exclusive: set add_generation_prompt to false",
                                  param="continue_final_message")
        conversation = [_template_message(m, i) for i, m in enumerate(messages)]
        kwargs = dict(template_kwargs or {})
        if tools is not None:  # the request's `tools` over a `tools` in chat_template_kwargs
            kwargs["tools"] = tools
        try:
            out = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True, **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - jinja raises many kinds; all are the caller's
            raise BadRequestError(f"the chat template failed: {e}", param="messages") from e
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)

    @property
    def vocab_size(self) -> int:
        """Token ids below this are the tokenizer's (added tokens included)."""
        return len(self.tokenizer)

    # ---- limits ---------------------------------------------------------------------------
    def resolve_max_tokens(self, prompt_len: int, requested: int | None, chat: bool) -> int:
        """The request's `max_tokens`, checked against the context; 400 when it does not fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input "
                f"{'messages' if chat else 'prompt'}.",
                param="messages" if chat else "prompt",
            )
        if requested is None:
            requested = limit - prompt_len if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if prompt_len + requested > limit:
            raise BadRequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({requested} > {limit} - {prompt_len}).",
                param="max_tokens",
            )
        return requested

    # ---- text -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> TokenIds:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: list[int]) -> list[str]:
        """The tokenizer's own pieces of `ids` (e.g. "Ġworld"), as vLLM's /tokenize returns them."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs name a token by)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: content a string (text parts joined by newlines)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type not in ("text", "input_text") or part.text is None:
                raise BadRequestError(
                    f"content part type {part.type!r} is not supported; only 'text' parts are",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out | template_tool_fields(message.model_extra or {}, index)
