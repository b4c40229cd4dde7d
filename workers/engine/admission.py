"""What makes a request unservable by an engine before it is tracked: its length against the
context and the KV pool, and token ids outside the vocabulary (a 400 for the client, never a
step's failure)."""

from __future__ import annotations

from workers.protocol import GenerateRequest


class RequestRejectedError(ValueError):
    """The request can never be served (too long for the context or the KV pool)."""


def check_token_ids(req: GenerateRequest, max_model_len: int, vocab: int) -> None:
    """Raise `RequestRejectedError` for a prompt that leaves no room in the context, or for
    token ids (prompt, `logit_bias`, `stop_token_ids`) outside the model's vocabulary."""
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
