"""A request's state inside an engine: its tokens, its KV pages and how far they are computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.detokenizer import IncrementalDetokenizer
from workers.protocol import FinishReason, LoRARequest, SamplingParams, TokenLogprob
from workers.sampling.constraint import Constraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its tokens
    RUNNING = "running"  # holds pages; prefilled in chunks, then decoded one token a step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # the prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stop_token_ids: frozenset[int] = frozenset()  # its stop_token_ids, and EOS unless ignored
    arrival_time: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV sits in `pages` (or is being written)
    num_pending_tokens: int = 0  # sampled by a step still running: counted, not yet in token_ids
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_node: Any = None  # radix node locked on behalf of this sequence
    num_tree_pages: int = 0  # leading `pages` that belong to the radix tree (held by the lock)
    generator: torch.Generator | None = None  # made by the runner, on its device, if seeded
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_emitted_tokens: int = 0  # output tokens already streamed out
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    first_token_time: float | None = None
    constraint: Constraint | None = None  # structured output / allowed_token_ids
    # speculative decoding: tokens drafted for the step being scheduled (verified by it, then
    # cleared), and the request's drafted and accepted tokens so far
    draft_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    cache_salt: str | None = None  # shares prefix-cache pages only with requests of this salt
    priority: int = 0  # lower runs first under the priority scheduling policy

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 for the base model (the prefix cache keys pages by it)."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's logprobs are asked for and not all computed yet."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def held_back_ids(self) -> frozenset[int]:
        """The stop tokens that `min_tokens` keeps the next sampled token from being."""
        if self.num_output_tokens + self.num_pending_tokens < self.params.min_tokens:
            return self.stop_token_ids
        return frozenset()

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV the next step may compute: the known ones, then the drafts."""
        return self.num_tokens + len(self.draft_ids) - self.num_computed_tokens
