"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs, and
logit bias and penalties (`workers/sampling/penalties.py`) first where rows ask for them.

Sampling draws `argmax(p / q)` with q ~ Exponential(1) per vocabulary entry, which picks token i
with probability p_i. Seeded requests draw q from their own generator, so their tokens do not
depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.sampling.penalties import LogitAdjustments
from workers.sampling.token_mask import apply_bitmask


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of 2-D `x`: the first index of each row's maximum (NaN counting as the
    maximum), as torch gives it. On CUDA torch reduces a row in one thread block (37 µs for one
    row of Llama-3's 128k logits on an H200, 1% of a batch-1 step); there two Triton launches
    reduce chunks of the row in parallel (`greedy_argmax`)."""
    if x.is_cuda and x.stride(-1) == 1:
        from workers.kernels import greedy_argmax  # Triton: imported on first CUDA use

        return greedy_argmax.argmax_rows(x)
    return x.argmax(dim=-1)


@dataclass
class SamplingBatch:
    """Per-row sampling rules, as tensors on the logits' device, plus what the rows need as a
    whole, known on the host so that sampling never waits for the device."""

    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int; <= 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    min_p: torch.Tensor  # [B] float; 0 = off
    generators: list[torch.Generator | None]
    num_logprobs: int  # top-N logprobs wanted by the most demanding row; -1 = none
    all_greedy: bool
    need_sort: bool  # some row filters by top-k or top-p
    need_min_p: bool
    adjust: LogitAdjustments | None = None  # rows with logit bias or penalties
    # rows with a token mask (structured outputs, allowed_token_ids): row ids [R], bitmask [R, W]
    mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # speculative decoding's verify rows: each row's draft [B] (-1: none), on the device and
    # the host (`accept_or_resample`)
    drafts: tuple[torch.Tensor, np.ndarray] | None = None

    @classmethod
    def from_rules(
        cls,
        rules: np.ndarray,
        generators: list[torch.Generator | None],
        num_logprobs: int,
        to_device: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
        adjust: LogitAdjustments | None = None,
    ) -> SamplingBatch:
        """`rules` `[4, B]` float64: temperature, top_k, top_p and min_p of each row (top_k
        below 2**53 is exact), moved to the device in one copy by `to_device`."""
        temperatures, top_k, top_p, min_p = to_device(np.ascontiguousarray(rules))
        return cls(
            temperatures=temperatures.float(),
            top_k=top_k.long(),
            top_p=top_p.float(),
            min_p=min_p.float(),
            generators=generators,
            num_logprobs=num_logprobs,
            all_greedy=bool((rules[0] == 0).all()),
            need_sort=bool((rules[1] > 0).any() or (rules[2] < 1).any()),
            need_min_p=bool((rules[3] > 0).any()),
            adjust=adjust,
        )


@dataclass
class SampleResult:
    """Sampled rows on the host."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # of the sampled token, from the raw distribution
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None  # of each token in its distribution, 1 = the most likely


@dataclass
class SampledTensors:
    """Sampled rows where they were computed; `to_host()` waits for them."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B]
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None  # [B]

    @staticmethod
    def cat(parts: list[SampledTensors]) -> SampledTensors:
        """Rows of `parts` in order (each part with the same fields set)."""

        def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]

        return SampledTensors(
            torch.cat([p.token_ids for p in parts]),
            cat([p.logprobs for p in parts]),
            cat([p.top_ids for p in parts]),
            cat([p.top_logprobs for p in parts]),
            cat([p.ranks for p in parts]),
        )

    def copy_to_host(self) -> SampledTensors:
        """Start copying every tensor into pinned host memory (CUDA); the copies are complete
        once the stream reaches this point. On the CPU this is the identity."""
        if not self.token_ids.is_cuda:
            return self

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        token_ids = copy(self.token_ids)
        assert token_ids is not None
        return SampledTensors(
            token_ids,
            copy(self.logprobs),
            copy(self.top_ids),
            copy(self.top_logprobs),
            copy(self.ranks),
        )

    def to_host(self) -> SampleResult:
        def lists(t: torch.Tensor | None) -> Any:
            return None if t is None else t.tolist()

        return SampleResult(
            self.token_ids.tolist(),
            lists(self.logprobs),
            lists(self.top_ids),
            lists(self.top_logprobs),
            lists(self.ranks),
        )


def apply_filters(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with -inf outside each row's top-k / top-p / min-p set."""
    temps = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones_like(sb.temperatures))
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    if sb.need_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(sb.top_k > 0, sb.top_k, vocab)
        drop = rank >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop entries whose preceding mass does.
        drop |= (probs.cumsum(dim=-1) - probs) >= sb.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if sb.need_min_p:
        probs = logits.softmax(dim=-1)
        floor = sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax(probs / noise)` per row, noise ~ Exponential(1). A draw can be exactly 0 (one
    in 2**24 on CUDA: dozens a minute at a 49k vocabulary), and 0 / 0 is NaN, which the argmax
    takes as the maximum: a token of probability 0 (masked, filtered) would win. Flooring the
    noise at the smallest normal float keeps every such quotient 0."""
    return argmax_rows(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny))


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampledTensors:
    """`logits` `[B, V]` float32 -> one token per row (plus logprobs if asked), on the logits'
    device and without waiting for it. Logprobs are those of the raw `logits`. The token
    masks go after the adjustments, so a bias or penalty never lets a masked token through.
    With `sb.drafts` a sampled row keeps its drafted token or draws another by
    `accept_or_resample`; a greedy row takes its argmax, which the host compares."""
    adjusted = logits if sb.adjust is None else sb.adjust.apply(logits)
    if sb.mask is not None:
        if adjusted is logits and sb.num_logprobs >= 0:  # logprobs are of the raw logits
            adjusted = logits.clone()
        apply_bitmask(adjusted, sb.mask[1], sb.mask[0])
    greedy = argmax_rows(adjusted)
    if sb.all_greedy:
        tokens = greedy
    else:
        probs = apply_filters(adjusted, sb).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(sb.generators):
            if gen is not None:
                noise[row] = torch.empty_like(probs[row]).exponential_(generator=gen)
        drawn = race(probs, noise) if sb.drafts is None else accept_or_resample(
            probs, noise, *sb.drafts, sb.generators
        )
        tokens = torch.where(sb.temperatures == 0, greedy, drawn)
    result = SampledTensors(token_ids=tokens)
    if sb.num_logprobs >= 0:
        logprobs = logits.log_softmax(dim=-1)
        result.logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        if sb.num_logprobs > 0:
            top = logprobs.topk(sb.num_logprobs, dim=-1)
            result.top_ids, result.top_logprobs = top.indices, top.values
    return result


def accept_or_resample(
    probs: torch.Tensor,
    noise: torch.Tensor,
    drafts: torch.Tensor,
    host_drafts: np.ndarray,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Rejection sampling of a deterministic proposal (speculative decoding): row i keeps its
    draft x with probability p_i(x), else draws from p_i with x taken out (renormalised by the
    race). So the row's token has distribution p_i whatever the draft, and it equals the draft
    only if accepted. Rows without a draft (-1) draw from p_i. Seeded rows draw from their own
    generators (the noise, then, with a draft, the acceptance: `host_drafts` says which rows
    have one without a wait for the device), so they reproduce whatever shares the batch."""
    has = drafts >= 0
    x = drafts.clamp_min(0)[:, None]
    uniform = torch.rand(len(drafts), device=probs.device)
    for row, gen in enumerate(generators):
        if gen is not None and host_drafts[row] >= 0:
            uniform[row] = torch.rand(1, generator=gen, device=probs.device)[0]
    accepted = has & (uniform < probs.gather(1, x).squeeze(1))
    residual = torch.where(has[:, None], probs.scatter(1, x, 0.0), probs)
    return torch.where(accepted, drafts, race(residual, noise))


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> SampledTensors:
    """The logprob and rank of each `targets` token (a prompt's next token) under its row of
    `logits`, and each row's `top_n` best; `token_ids` holds the targets."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    result = SampledTensors(
        token_ids=targets,
        logprobs=chosen.squeeze(-1),
        ranks=(logprobs > chosen).sum(dim=-1) + 1,
    )
    if top_n > 0:
        top = logprobs.topk(top_n, dim=-1)
        result.top_ids, result.top_logprobs = top.indices, top.values
    return result
