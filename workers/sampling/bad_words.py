"""`SamplingParams.bad_words` (vLLM's): words the output may not contain. A word is the token
sequences it encodes to, with and without a leading space; the last token of a sequence is held
back from the next sample wherever its other tokens end the output so far (a one-token word:
always). The request's `Constraint` clears those tokens from its row of the step's bitmask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TokenSeqs = tuple[tuple[int, ...], ...]


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> TokenSeqs:
    """Each word's token sequences: as written (leading spaces stripped), and after a space
    where that encodes to another first token but as many tokens (vLLM's rule: a word
    mid-sentence is usually the spaced form)."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        seqs.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            seqs.append(spaced)
    return tuple(seqs)


def banned_after(seqs: TokenSeqs, output: Sequence[int]) -> list[int]:
    """The tokens the next sample may not be, after `output` (the request's output tokens)."""
    banned = []
    for seq in seqs:
        prefix = len(seq) - 1
        if prefix == 0 or (len(output) >= prefix and tuple(output[-prefix:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned
