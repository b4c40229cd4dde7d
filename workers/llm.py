"""The offline API, shaped like `vllm.LLM`: a batch of prompts in, one output per prompt out."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from pydantic import BaseModel
from tqdm import tqdm

from workers.config import DEFAULT_MODEL, EngineConfig
from workers.engine.engine import Engine
from workers.protocol import (
    FinishReason,
    GenerateRequest,
    LoRARequest,
    SamplingParams,
    TokenLogprob,
    truncated_prompt,
)

Prompt = str | list[int]
Message = dict[str, Any]


class GenerationOutput(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
    error: str | None = None
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for this request
    num_accepted_tokens: int = 0  # of which the target accepted


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks 1..N-1 (nothing to stop with one rank)."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        priority: Seq[int] | None = None,
    ) -> list[GenerationOutput]:
        """Run every prompt to completion as one continuously batched workload; with
        `lora_request` (one for all prompts, or one per prompt, None for the base model) under
        those LoRA adapters; `priority` (one per prompt, lower first) where the engine's
        `scheduling_policy` is "priority", as vLLM's."""
        batch = _as_prompt_list(prompts)
        plist = params if isinstance(params, Seq) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} sampling params")
        loras = lora_request if isinstance(lora_request, Seq) else [lora_request] * len(batch)
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} LoRA requests")
        priorities = [0] * len(batch) if priority is None else list(priority)
        if len(priorities) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(priorities)} priorities")
        outputs: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p, lora, rank in zip(batch, plist, loras, priorities):
            ids = truncated_prompt(self._encode(prompt), p.truncate_prompt_tokens,
                                   self.engine.max_model_len)  # fmt: skip
            rid = f"offline-{next(self._ids)}"
            req = GenerateRequest(request_id=rid, prompt_token_ids=ids, params=p, lora=lora,
                                  priority=rank)  # fmt: skip
            self.engine.add_request(req)
            outputs[rid] = GenerationOutput(
                request_id=rid,
                prompt_token_ids=ids,
                token_ids=[],
                text="",
                finish_reason=None,
                logprobs=[] if p.logprobs is not None else None,
            )
            order.append(rid)
        with tqdm(total=len(batch), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_work():
                for chunk in self.engine.step():
                    out = outputs[chunk.request_id]
                    out.token_ids += chunk.token_ids
                    out.text += chunk.text
                    if out.logprobs is not None and chunk.logprobs:
                        out.logprobs += chunk.logprobs
                    if chunk.prompt_logprobs is not None:
                        out.prompt_logprobs = chunk.prompt_logprobs
                    out.num_cached_tokens = chunk.num_cached_tokens
                    out.num_draft_tokens = chunk.num_draft_tokens
                    out.num_accepted_tokens = chunk.num_accepted_tokens
                    if chunk.finished:
                        out.finish_reason, out.stop_reason = chunk.finish_reason, chunk.stop_reason
                        out.error = chunk.error
                        bar.update(1)
        return [outputs[rid] for rid in order]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]
