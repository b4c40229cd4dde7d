"""LoRA products over a batch whose tokens run with different adapters (S-LoRA/Punica's shrink
and expand, in torch), as a fixed number of dense products whatever the mix: every token's rows
times every slot's A at once (shrink), the rank columns of slots other than the token's own
zeroed by a one-hot mask, then times every slot's B (expand), added into the base output.

Launches per projection do not grow with the adapters in the step (a loop over slots cost a
gather, two products and a scatter each: ~170 launches a Llama layer with 8 adapters), and the
shapes depend only on the token count, so a step can be captured. The extra work is the zero
columns: `slots x rank` of them per token, small beside the base product. On CUDA a batch of at
most `lora_sgmv.MAX_TOKENS` tokens takes the two-launch Triton kernels of `lora_sgmv` instead.

A fused projection (q/k/v, gate/up) stacks its parts' A along the rank, `[parts x rank, in]`,
so one shrink serves them all; each part's slice of the output takes its rank slice of the
shrunk rows times its rows of B.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def add_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
    out_parts: list[int], sumsq: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`y` [T, out] plus the LoRA products of x's rows [T, in], in place: `a` [slots, parts x
    rank, in], `b` [out, slots, rank], `mask` [T, slots] one-hot of each token's slot (a zero
    row: the base model alone), `out_parts` the parts' sizes along y's last dimension.
    `sumsq` [T, k] float64: partial sums of the squares of x's rows (`skinny_gemm`'s
    `sumsq_out`); the products are then of x's rows RMS-normalised with `eps` (x the stream
    into a norm whose gain is folded into A), scaled after the shrink, as the base GEMM does."""
    if x.is_cuda:
        from workers.kernels import lora_sgmv  # Triton: imported on first CUDA use

        if x.shape[0] <= lora_sgmv.MAX_TOKENS and len(out_parts) <= lora_sgmv.MAX_PARTS:
            return lora_sgmv.sgmv_add_lora(x.contiguous(), y, a, b, mask, out_parts, sumsq, eps)
    return masked_add_lora(x, y, a, b, mask, out_parts, sumsq, eps)


def lora_beside(
    base: Callable[[], torch.Tensor], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    mask: torch.Tensor, out_parts: list[int], sumsq: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`base()` (the base GEMM of x's rows) and, apart, the LoRA products of the same rows
    (`add_lora` into zeros), run on CUDA on a second stream beside `base()`: they wait for x
    only, not for the GEMM; both are done on the current stream when this returns. In a CUDA
    graph being captured the two streams are two branches of it."""
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    # Allocated by the main stream, which frees it after its add, once the side has joined.
    products = torch.empty((x.shape[0], b.shape[0]), dtype=x.dtype, device=x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        add_lora(x, products.zero_(), a, b, mask, out_parts, sumsq, eps)
    y = base()
    main.wait_stream(side)
    return y, products


def add_lora_beside(
    base: Callable[[], torch.Tensor], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    mask: torch.Tensor, out_parts: list[int], sumsq: torch.Tensor | None = None,
    eps: float = 0.0, sums_out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`add_lora(x, base(), ...)` with the products beside `base()` (`lora_beside`), their sum
    added to its output once both have run (one more launch). In that launch, `sums_out`: the
    sums of squares of the output's rows that `base()` wrote (`residual_linear`) redone for
    the rows with the products added."""
    y, products = lora_beside(base, x, a, b, mask, out_parts, sumsq, eps)
    if sums_out is None:
        return y.add_(products)
    from workers.kernels import fused  # Triton: imported on first CUDA use

    return fused.add_square_sums(y, products, sums_out)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The LoRA products' stream on `device`: high priority, so that their few small launches
    take multiprocessors ahead of the base GEMM's waiting programs."""
    return torch.cuda.Stream(device, priority=-1)


def masked_add_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
    out_parts: list[int], sumsq: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`add_lora` as the masked dense products, on any device."""
    tokens, (slots, stacked, _), rank = x.shape[0], a.shape, b.shape[-1]
    parts = stacked // rank
    shrunk = (x @ a.view(slots * stacked, -1).t()).view(tokens, slots, parts, rank)
    if sumsq is not None:
        inv_rms = torch.rsqrt(sumsq.sum(dim=1) / x.shape[1] + eps)  # float64, as the sums
        mask = mask * inv_rms.to(mask.dtype)[:, None]
    shrunk = shrunk * mask.view(tokens, slots, 1, 1)
    if parts == 1:
        y += shrunk.view(tokens, slots * rank) @ b.view(b.shape[0], slots * rank).t()
        return y
    start = 0
    for p, size in enumerate(out_parts):
        rows = b[start : start + size].view(size, slots * rank)
        y[:, start : start + size] += shrunk[:, :, p].reshape(tokens, slots * rank) @ rows.t()
        start += size
    return y
