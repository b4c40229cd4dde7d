"""Tokens per engine step as a cumulative histogram: what vLLM exports as iteration_tokens_total.

vLLM counts a step's tokens as its outputs see them: the tokens generated in the step, plus the
whole prompt of each request whose first token it produced (cached prompt tokens included, a
prompt split over chunks counted once, in the step that ends it). Steps that produced no token
(a prefill chunk that is not a prompt's last) are not observed. 10 requests of 9 prompt tokens
and 10 generated count 190 in all, whatever the batching.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager

from workers.engine_stats import ITERATION_TOKENS_BUCKETS
from workers.sequence import Sequence


class StepTokens:
    """Counts of steps per bucket bound (cumulative, +Inf last) and the tokens' sum."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        """One step that counted `num_tokens` tokens (`StepCount`)."""
        for i in range(bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens), len(self.buckets)):
            self.buckets[i] += 1
        self.sum += num_tokens


class StepCount:
    """One step's tokens as vLLM counts them, summed over the sequences that got tokens."""

    def __init__(self) -> None:
        self.tokens = 0
        self.sequences = 0

    @contextmanager
    def tokens_of(self, seq: Sequence) -> Iterator[None]:
        """Count what `seq` gains inside the block: its new tokens, and its prompt if the block
        gave it its first output token."""
        before = seq.num_output_tokens
        yield
        gained = seq.num_output_tokens - before
        if gained:
            self.sequences += 1
            self.tokens += gained + (seq.num_prompt_tokens if before == 0 else 0)
