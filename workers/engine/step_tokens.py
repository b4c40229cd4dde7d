"""Tokens per engine step as a cumulative histogram: what vLLM exports as iteration_tokens_total."""

from __future__ import annotations

from bisect import bisect_left

from workers.protocol import ITERATION_TOKENS_BUCKETS


class StepTokens:
    """Counts of steps per bucket bound (cumulative, +Inf last) and the tokens' sum."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        """One step that computed `num_tokens` tokens (prompt and generated)."""
        for i in range(bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens), len(self.buckets)):
            self.buckets[i] += 1
        self.sum += num_tokens
