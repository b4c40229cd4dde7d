"""LoRA products over a batch whose tokens run with different adapters (S-LoRA/Punica's
shrink and expand, in torch): for each adapter slot of the step, its tokens' rows times the
slot's stacked A (shrink to the rank), then times B (expand), added into the base output.

A fused projection (q/k/v, gate/up) stacks its parts' A along the rank, `[parts x rank, in]`,
so one shrink serves them all; each part's slice of the output takes its own rank slice of the
shrunk rows times its rows of B, `[out, rank]`.
"""

from __future__ import annotations

import torch

# (slot, the rows of the step's tokens that run with it; None: every row)
Groups = list[tuple[int, "torch.Tensor | None"]]


def add_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: Groups,
    out_parts: list[int],
) -> torch.Tensor:  # fmt: skip
    """`y` plus the LoRA products of x's rows, in place: `a` [slots, parts x rank, in], `b`
    [slots, out, rank], `out_parts` the parts' sizes along y's last dimension."""
    rank = b.shape[-1]
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        shrunk = xs @ a[slot].t()
        if len(out_parts) == 1:
            delta = shrunk @ b[slot].t()
        else:
            slices = b[slot].split(out_parts, dim=0)
            delta = torch.cat(
                [shrunk[:, p * rank : (p + 1) * rank] @ bp.t() for p, bp in enumerate(slices)],
                dim=-1,
            )
        if rows is None:
            y += delta
        else:
            y.index_add_(0, rows, delta)
    return y
