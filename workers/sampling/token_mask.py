"""Token bitmasks applied to logits on their device: bit j of word w of a row allows token
32 * w + j. The grammar matchers fill the bitmask on the host (`workers/sampling/grammar.py`);
one copy takes it to the device, where one Triton kernel (`workers/kernels/token_bitmask.py`) or,
on the CPU, a few elementwise ops apply it. Columns past the bitmask (logits wider than the
tokenizer's vocabulary) are never allowed."""

from __future__ import annotations

import torch

BITS = 32


def bitmask_words(vocab: int) -> int:
    """int32 words per row of a bitmask over `vocab` tokens."""
    return -(-vocab // BITS)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set `logits[rows[i], t]` to -inf, in place, wherever bit t of `bitmask[i]` is clear.
    `bitmask` `[R, W]` int32 and `rows` `[R]` int64 on the logits' device; when every row of
    `logits` is masked (R equals its rows), `rows` must be `0..R-1`."""
    if logits.is_cuda:
        from workers.kernels.token_bitmask import apply_bitmask_cuda

        apply_bitmask_cuda(logits, bitmask, rows)
        return
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    # contiguous operands: a broadcast over a last dimension of 32 is 30x slower on the CPU
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device).repeat(words)
    width = min(vocab, words * BITS)
    bits = (bitmask.repeat_interleave(BITS, dim=1)[:, :width] >> shifts[:width]) & 1
    blocked = bits == 0
    whole = len(rows) == logits.shape[0]
    target = logits if whole else logits[rows]
    target[:, :width].masked_fill_(blocked, float("-inf"))
    if width < vocab:  # logits wider than the bitmask's vocabulary
        target[:, width:] = float("-inf")
    if not whole:
        logits[rows] = target
