"""Each step's sampling inputs on the device: the rows' rules, logit adjustments (bias,
penalties, `min_tokens`) and token masks (structured outputs, `allowed_token_ids`).

With overlap scheduling a sequence's newest output token may still be pending: sampled by the
launch before this one. Penalties take it from the device; a grammar matcher, which runs on the
host, takes it from that launch's copy to the host, which has been under way since then, while
the device already runs this step's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from workers.sampling.constraint import MaskFiller
from workers.sampling.penalties import LogitAdjustments, adjusts_logits
from workers.sampling.sampler import SamplingBatch
from workers.scheduler.step import LaunchedStep
from workers.sequence import Sequence

Prev = tuple[torch.Tensor, dict[Sequence, int]]  # a launch's sampled ids, each sequence's row
Masks = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the token masks' row ids and bitmask


class SamplingInputs:
    def __init__(
        self,
        device: torch.device,
        vocab: int,
        to_device: Callable[[np.ndarray], torch.Tensor],
        fill_threads: int,
    ) -> None:
        self.device = device
        self.vocab = vocab  # the logits' width
        self.to_device = to_device
        self.fill_threads = fill_threads
        self._masks: MaskFiller | None = None  # made at the first constrained row

    def batch(
        self, seqs: list[Sequence], prev: Prev | None, prev_launch: LaunchedStep | None
    ) -> tuple[SamplingBatch, Masks | None]:
        """The sampling rules of `seqs`' rows, and their token masks (none if no row is
        constrained) being filled: `sb.mask = masks()` before sampling, and no matcher may be
        called meanwhile. `prev` / `prev_launch`, the launch before this one, hold the newest
        output token of each sequence whose token is still pending."""
        self.ensure_generators(seqs)
        params = [s.params for s in seqs]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        rules = np.array([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params]).T
        adjust = None
        held_back = [s.held_back_ids for s in seqs]
        if any(adjusts_logits(p) for p in params) or any(held_back):
            pending = [prev[1][s] if prev and s.num_pending_tokens else None for s in seqs]
            adjust = LogitAdjustments.build(
                params,
                prompts=[s.token_ids[: s.num_prompt_tokens] for s in seqs],
                outputs=[s.output_token_ids for s in seqs],
                vocab=self.vocab,
                to_device=self.to_device,
                in_flight=None if prev is None else (prev[0], pending),
                held_back=held_back,
            )
        sb = SamplingBatch.from_rules(
            rules,
            generators=[s.generator for s in seqs],
            num_logprobs=max(logprobs) if logprobs else -1,
            to_device=self.to_device,
            adjust=adjust,
        )
        return sb, self._token_masks(seqs, prev, prev_launch)

    def ensure_generators(self, seqs: list[Sequence]) -> None:
        """Give each seeded sequence its generator, on this device, at its first step."""
        for seq in seqs:
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed % 2**64)

    def _token_masks(
        self, seqs: list[Sequence], prev: Prev | None, prev_launch: LaunchedStep | None
    ) -> Masks | None:
        """The row ids and bitmask of `seqs`' constrained rows on the device (None if none is),
        each matcher first brought to its sequence's output."""
        rows = [r for r, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None
        constraints = []
        pending = None
        for r in rows:
            seq = seqs[r]
            assert seq.constraint is not None
            output = seq.output_token_ids
            if seq.num_pending_tokens:
                assert prev is not None and prev_launch is not None
                pending = pending or prev_launch.result()
                assert pending is not None
                output = [*output, pending.token_ids[prev[1][seq]]]
            seq.constraint.sync(output)
            constraints.append(seq.constraint)
        if self._masks is None:
            self._masks = MaskFiller(self.vocab, self.device, self.fill_threads)
        filling = self._masks.start(constraints)
        row_ids = self.to_device(np.asarray(rows, dtype=np.int64))
        return lambda: (row_ids, filling.result())
