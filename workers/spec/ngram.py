"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), in its prompt
or its output. No model: it pays off where the output repeats its context (edits, rewrites,
quotes, code), and proposes nothing elsewhere."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` drafts after `tokens` (1-D int array); [] when no suffix of n_min..n_max tokens
    occurred before."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows starting at 0..size-1-n: each one is followed by at least one token
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
