"""The LoRA hook of the dense projections: `y = lora.add(name, x, y)` after the base product.

`LoRAContext.step` says which adapter slots this step's tokens run with; None (a step of base
requests only) and the hooks are never reached. A step holding adapters runs the model's path
for its size with the hooks, eagerly or in its size's LoRA CUDA graph, captured on a static mask
that each replay refills (`workers/engine/cuda_graph.py`). On the folded path (norm gains in
the weights, `LlamaForCausalLM.fold_norm_gains`) q/k/v and gate/up shrink the raw stream and
scale by the row's 1/rms as their GEMM does (`rms_linear`), and o's and down's products go into
the residual stream before the GEMM that adds its own. The stacks are filled by
`workers/lora/slots.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.kernels.lora_ops import add_lora, add_lora_beside
from workers.model.layers import RMSNorm, linear, rms_linear


@dataclass
class LoRAStep:
    mask: torch.Tensor  # [tokens, slots]: one-hot of each token's slot, zeros for base tokens


class LoRAContext:
    """Shared by a model's hooks: the step being run, set around its forward; `side_stream`:
    on CUDA, a projection's products run beside its base GEMM (`add_lora_beside`)."""

    def __init__(self, side_stream: bool = False) -> None:
        self.step: LoRAStep | None = None
        self.side_stream = side_stream


@dataclass
class ProjectionStack:
    """One projection's adapters, slot by slot: A [slots, parts x rank, in] (this rank's input
    columns for a row-parallel one), B [out, slots, rank] (this rank's output rows for a
    column-parallel one; slot-major within a row, so every slot's B is one matrix), and the
    parts' sizes along the output."""

    a: torch.Tensor
    b: torch.Tensor
    out_parts: list[int]


class LayerLoRA:
    """A layer's hook: its projections' stacks, read under the model's context."""

    def __init__(self, context: LoRAContext, stacks: dict[str, ProjectionStack]) -> None:
        self.context = context
        self.stacks = stacks

    @property
    def active(self) -> bool:
        return self.context.step is not None

    def add(
        self, name: str, x: torch.Tensor, y: torch.Tensor, sumsq: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor:  # fmt: skip
        """`y` plus `name`'s products of x's rows, in place (`add_lora`; `sumsq`: of x's rows
        RMS-normalised)."""
        step, stack = self.context.step, self.stacks.get(name)
        if step is None or stack is None:
            return y
        return add_lora(x, y, stack.a, stack.b, step.mask, stack.out_parts, sumsq, eps)

    def linear(
        self, name: str, x: torch.Tensor, base: Callable[[], torch.Tensor],
        sumsq: torch.Tensor | None = None, eps: float = 0.0,
    ) -> torch.Tensor:  # fmt: skip
        """`base()` (the base product of x's rows) plus `name`'s products of them: beside it
        on a second stream where the context says so (`add_lora_beside`), else after it."""
        step, stack = self.context.step, self.stacks.get(name)
        if step is not None and stack is not None and self.context.side_stream and x.is_cuda:
            return add_lora_beside(base, x, stack.a, stack.b, step.mask, stack.out_parts, sumsq,
                                   eps)  # fmt: skip
        return self.add(name, x, base(), sumsq, eps)

    def rms_linear(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        norm: RMSNorm, sumsq: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """`rms_linear(x, weight, bias, norm, sumsq)` plus `name`'s products of the same normed
        rows: of x scaled by 1/rms where `sumsq` holds its sums of squares, else of `norm(x)`,
        run once for both."""
        if sumsq is None:
            h = norm(x)
            return self.linear(name, h, lambda: linear(h, weight, bias))
        return self.linear(name, x, lambda: rms_linear(x, weight, bias, norm, sumsq), sumsq,
                           norm.eps)  # fmt: skip
