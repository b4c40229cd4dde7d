"""A token bitmask applied to CUDA logits in one Triton launch (`sampling.token_mask`).

The torch form expands the bitmask to one int32 per logit and runs four elementwise kernels over
`[rows, vocab]` (for Llama-3's 128k vocabulary and 64 rows, ~160 MB of traffic). Here each
program reads its block's bitmask words and writes -inf only where a token is blocked: the
logits are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_kernel(
    logits_ptr, stride, bitmask_ptr, words, rows_ptr, vocab, BLOCK: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + r)
    inside = col < vocab
    word = col // 32
    # past the bitmask's words (logits wider than the vocabulary): 0, never allowed
    bits = tl.load(bitmask_ptr + r * words + word, mask=inside & (word < words), other=0)
    blocked = inside & (((bits >> (col % 32)) & 1) == 0)
    tl.store(logits_ptr + row * stride + col, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=blocked)  # fmt: skip


def apply_bitmask_cuda(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`sampling.token_mask.apply_bitmask` for float32 CUDA logits with a unit column stride."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    vocab = logits.shape[1]
    grid = (bitmask.shape[0], triton.cdiv(vocab, BLOCK))
    _apply_kernel[grid](
        logits, logits.stride(0), bitmask.contiguous(), bitmask.shape[1], rows, vocab, BLOCK=BLOCK
    )
