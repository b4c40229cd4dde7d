"""Logit bias, the repetition, frequency and presence penalties and `min_tokens`, as vLLM applies
them.

For the rows that ask for any of them, on the raw logits and before temperature and the top-k /
top-p / min-p filters: first `logit_bias` is added; then a token seen in the prompt or the
output has its logit divided by `repetition_penalty` if positive, multiplied by it otherwise;
then `frequency_penalty` times the token's count in the output and `presence_penalty` (once, if
it occurs there) are subtracted; last, while a row has fewer than `min_tokens` output tokens,
its stop tokens (EOS, stop_token_ids) get -inf, so it cannot end early. Returned logprobs stay
those of the raw logits (vLLM's default).

The token lists go to the device once per step, padded with the id `vocab` (a column past the
vocabulary, cut off after the scatter). With overlap scheduling a sequence's newest output token
may still be on the device, sampled by the step in flight: `build` takes it from there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.protocol import SamplingParams

ToDevice = Callable[[np.ndarray], torch.Tensor]


def adjusts_logits(params: SamplingParams) -> bool:
    """Whether `params` changes the logits before sampling (so greedy is not the raw argmax)."""
    return bool(
        params.logit_bias
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


@dataclass
class LogitAdjustments:
    rows: torch.Tensor  # [R] int64: the batch rows adjusted
    rules: torch.Tensor  # [3, R] float32: repetition, frequency, presence penalty
    prompt_ids: torch.Tensor  # [R, P] int64, padded with vocab
    output_ids: torch.Tensor  # [R, O] int64, padded with vocab
    bias: torch.Tensor  # [3, B] float64: adjusted row index (into `rows`), token id, bias
    banned: torch.Tensor  # [2, N] int64: adjusted row index, token id held back (-inf)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab: int,
        to_device: ToDevice = torch.from_numpy,
        in_flight: tuple[torch.Tensor, Sequence[int | None]] | None = None,
        held_back: Sequence[Collection[int]] | None = None,
    ) -> LogitAdjustments | None:
        """The adjustments of a batch whose row i has `params[i]`, prompt `prompts[i]` and output
        so far `outputs[i]`; None if no row has any. `vocab`: the logits' width. `in_flight`:
        sampled ids on the device and, per row, the index of that row's newest output token
        among them (None: none pending), which then follows `outputs[i]`. `held_back`: per row,
        the token ids it may not sample now (`Sequence.held_back_ids`)."""
        held = held_back or [()] * len(params)
        rows = [i for i, p in enumerate(params) if adjusts_logits(p) or held[i]]
        if not rows:
            return None
        # Rows only held back (min_tokens) have neutral penalties: their tokens need no upload.
        penalised = [adjusts_logits(params[i]) for i in rows]
        pending = [
            in_flight[1][i] if in_flight is not None and pen else None
            for i, pen in zip(rows, penalised)
        ]
        # a pending token's place holds the padding id until it is filled on the device
        outs = [
            [*outputs[i], vocab] if p is not None else outputs[i] if pen else []
            for i, p, pen in zip(rows, pending, penalised)
        ]
        rules = np.array(
            [
                [params[i].repetition_penalty for i in rows],
                [params[i].frequency_penalty for i in rows],
                [params[i].presence_penalty for i in rows],
            ],
            dtype=np.float32,
        )
        bias = np.array(
            [(r, tok, b) for r, i in enumerate(rows) for tok, b in params[i].logit_bias],
            dtype=np.float64,
        ).reshape(-1, 3)
        adjust = cls(
            rows=to_device(np.asarray(rows, dtype=np.int64)),
            rules=to_device(rules),
            prompt_ids=to_device(
                _padded([prompts[i] if pen else [] for i, pen in zip(rows, penalised)], vocab)
            ),
            output_ids=to_device(_padded(outs, vocab)),
            bias=to_device(np.ascontiguousarray(bias.T)),
            banned=to_device(
                np.array([(r, t) for r, i in enumerate(rows) for t in sorted(held[i])], np.int64)
                .reshape(-1, 2)
                .T.copy()
            ),
        )
        fill = [(r, len(outs[r]) - 1, p) for r, p in enumerate(pending) if p is not None]
        if fill and in_flight is not None:
            where = to_device(np.asarray(fill, dtype=np.int64).T.copy())
            adjust.output_ids[where[0], where[1]] = in_flight[0][where[2]]
        return adjust

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[batch, vocab]` float32 with the adjusted rows changed (a new tensor)."""
        vocab = logits.shape[1]
        x = logits[self.rows]
        bias_rows, bias_ids = self.bias[0].long(), self.bias[1].long()
        x.index_put_((bias_rows, bias_ids), self.bias[2].float(), accumulate=True)
        counts = torch.zeros(x.shape[0], vocab + 1, device=x.device)
        counts.scatter_add_(1, self.output_ids, torch.ones_like(self.output_ids, dtype=x.dtype))
        counts = counts[:, :vocab]
        in_output = counts > 0
        seen = torch.zeros(x.shape[0], vocab + 1, dtype=torch.bool, device=x.device)
        seen = seen.scatter_(1, self.prompt_ids, True)[:, :vocab] | in_output
        repetition, frequency, presence = (r[:, None] for r in self.rules)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * in_output
        x[self.banned[0], self.banned[1]] = float("-inf")
        out = logits.clone()
        out[self.rows] = x
        return out


def _padded(lists: Sequence[Sequence[int]], pad: int) -> np.ndarray:
    out = np.full((len(lists), max((len(v) for v in lists), default=0)), pad, dtype=np.int64)
    for r, v in enumerate(lists):
        out[r, : len(v)] = v
    return out
