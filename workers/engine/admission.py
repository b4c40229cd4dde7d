"""What makes a request unservable by an engine before it is tracked: its length against the
context and the KV pool, token ids outside the vocabulary, a priority the scheduling policy does
not use (a 400 for the client, never a step's failure); and the state it is tracked by.
"""

from __future__ import annotations

from typing import Any

from workers.config import SchedulingPolicy
from workers.detokenizer import IncrementalDetokenizer
from workers.protocol import GenerateRequest, LoRARequest
from workers.sampling.constraint import Constraint
from workers.sequence import Sequence


class RequestRejectedError(ValueError):
    """The request can never be served (too long for the context or the KV pool)."""


def check_request(
    req: GenerateRequest, policy: SchedulingPolicy, max_model_len: int, vocab: int
) -> None:
    """Raise `RequestRejectedError` for a priority under the fcfs policy (vLLM's answer), a
    prompt that leaves no room in the context, or token ids (prompt, `logit_bias`,
    `stop_token_ids`) outside the model's vocabulary."""
    if req.priority != 0 and policy != "priority":
        raise RequestRejectedError(
            f"Got priority {req.priority} but priority scheduling is not enabled: start the "
            "engine with scheduling_policy='priority'"
        )
    n = len(req.prompt_token_ids)
    if n >= max_model_len:
        raise RequestRejectedError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your request has {n} input tokens. Please reduce the length of the input."
        )
    if max(req.prompt_token_ids) >= vocab:
        raise RequestRejectedError("prompt holds token ids outside the model's vocabulary")
    if any(token >= vocab for token, _ in req.params.logit_bias):
        raise RequestRejectedError("logit_bias names token ids outside the model's vocabulary")
    if any(token >= vocab for token in req.params.stop_token_ids):  # min_tokens bans them
        raise RequestRejectedError("stop_token_ids names token ids outside the model's vocabulary")


def check_pages(req: GenerateRequest, max_model_len: int, page_size: int, usable: int) -> None:
    """Raise `RequestRejectedError` for a request whose longest KV outgrows the whole pool."""
    longest = min(len(req.prompt_token_ids) + req.params.max_tokens, max_model_len)
    pages = -(-longest // page_size)
    if pages > usable:
        raise RequestRejectedError(f"request needs up to {pages} KV pages; the pool holds {usable}")


def new_sequence(
    req: GenerateRequest, tokenizer: Any, eos_token_ids: frozenset[int],
    constraint: Constraint | None, lora: LoRARequest | None,
) -> Sequence:  # fmt: skip
    """The state an admitted request is tracked by (its checks passed)."""
    p = req.params
    detokenizer = IncrementalDetokenizer(tokenizer, list(req.prompt_token_ids),
                                         p.skip_special_tokens, p.stop,
                                         p.include_stop_str_in_output)  # fmt: skip
    return Sequence(
        request_id=req.request_id,
        token_ids=list(req.prompt_token_ids),
        num_prompt_tokens=len(req.prompt_token_ids),
        params=p,
        stop_token_ids=frozenset(p.stop_token_ids)
        | (frozenset() if p.ignore_eos else eos_token_ids),
        detokenizer=detokenizer,
        constraint=constraint,
        lora=lora,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )
