"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Sampling draws `argmax(p / q)` with q ~ Exponential(1) per vocabulary entry, which picks token i
with probability p_i. Seeded requests draw q from their own generator, so their tokens do not
depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling rules, as tensors on the logits' device."""

    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int; <= 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    min_p: torch.Tensor  # [B] float; 0 = off
    generators: list[torch.Generator | None]
    num_logprobs: int  # top-N logprobs wanted by the most demanding row; -1 = none

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of the sampled token, from the raw distribution
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def apply_filters(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with -inf outside each row's top-k / top-p / min-p set."""
    temps = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones_like(sb.temperatures))
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    need_sort = bool(((sb.top_k > 0) & (sb.top_k < vocab)).any() or (sb.top_p < 1).any())
    if need_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(sb.top_k > 0, sb.top_k, vocab)
        drop = rank >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop entries whose preceding mass does.
        drop |= (probs.cumsum(dim=-1) - probs) >= sb.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if bool((sb.min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        floor = sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """`logits` `[B, V]` float32 -> one token per row (plus logprobs if asked)."""
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        tokens = greedy
    else:
        probs = apply_filters(logits, sb).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(sb.generators):
            if gen is not None:
                noise[row] = torch.empty_like(probs[row]).exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(sb.temperatures == 0, greedy, sampled)
    result = SampleResult(token_ids=tokens.tolist())
    if sb.num_logprobs >= 0:
        logprobs = logits.log_softmax(dim=-1)
        result.logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        if sb.num_logprobs > 0:
            top = logprobs.topk(sb.num_logprobs, dim=-1)
            result.top_ids, result.top_logprobs = top.indices.tolist(), top.values.tolist()
    return result
