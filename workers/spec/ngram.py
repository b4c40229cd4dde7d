"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), in its prompt
or its output. No model: it pays off where the output repeats its context (edits, rewrites,
quotes, code), and proposes nothing elsewhere.

The search runs on the host before every step, so it is kept to one pass over the sequence:
the earlier occurrences of its last token, then, at those places only, the longer suffixes.
`TokenArrays` keeps each sequence's tokens as a numpy array that grows with it, so a step does
not convert the whole token list again.
"""

from __future__ import annotations

import numpy as np

from workers.sequence import Sequence


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` drafts after `tokens` (1-D int array); [] when no suffix of n_min..n_max tokens
    occurred before."""
    size = len(tokens)
    # places p < size - 1 (each followed by a token) where the last token occurred before
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    back = np.arange(n_max)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        room = ends[ends >= n - 1]  # n tokens end there
        same = (tokens[room[:, None] - back[:n]] == tokens[size - 1 - back[:n]]).all(axis=1)
        hits = room[same]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


class TokenArrays:
    """Each sequence's tokens as an int64 array, extended by the tokens added since last asked."""

    def __init__(self) -> None:
        self._arrays: dict[Sequence, tuple[np.ndarray, int]] = {}  # buffer, tokens in it

    def get(self, seq: Sequence) -> np.ndarray:
        buffer, n = self._arrays.get(seq, (np.empty(0, np.int64), 0))
        size = len(seq.token_ids)
        if size > len(buffer):
            grown = np.empty(max(size, 2 * len(buffer)), np.int64)
            grown[:n] = buffer[:n]
            buffer = grown
        buffer[n:size] = seq.token_ids[n:size]
        self._arrays[seq] = (buffer, size)
        return buffer[:size]

    def drop(self, seq: Sequence) -> None:
        self._arrays.pop(seq, None)
