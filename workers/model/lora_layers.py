"""The LoRA hook of the dense projections: `y = lora.add(name, x, y)` after the base product.

`LoRAContext.step` says which adapter slots this step's tokens run with; None (a step of base
requests only) and the hooks are never reached. A step holding adapters runs the model's path
for its size with the hooks, eagerly or in its size's LoRA CUDA graph, captured on a static mask
that each replay refills (`workers/engine/cuda_graph.py`). On the folded path (norm gains in
the weights, `LlamaForCausalLM.fold_norm_gains`) q/k/v and gate/up shrink the raw stream and
scale by the row's 1/rms as their GEMM does (`rms_linear`), and o's and down's products go into
the residual stream before the GEMM that adds its own, or beside it and after it
(`residual_linear`). The stacks are filled by `workers/lora/slots.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.kernels.lora_ops import add_lora, add_lora_beside, lora_beside
from workers.model.layers import RMSNorm, linear, residual_linear, rms_linear, silu_and_mul

if TYPE_CHECKING:
    from workers.kernels.lora_sgmv import ShrunkRows


@dataclass
class LoRAStep:
    mask: torch.Tensor  # [tokens, slots]: one-hot of each token's slot, zeros for base tokens


class LoRAContext:
    """Shared by a model's hooks: the step being run, set around its forward; `products`
    (`KernelConfig.lora_products`): on CUDA, whether a projection's products run after its base
    GEMM, beside it (`add_lora_beside`) or in its epilogue where it takes them (`shrunk`)."""

    def __init__(self, products: str = "after") -> None:
        self.step: LoRAStep | None = None
        self.products = products


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
        sumsq: torch.Tensor | None = None, eps: float = 0.0, sums_out: torch.Tensor | None = None,
        gated: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """`base()` (the base product of x's rows) plus `name`'s products of them (`gated`: the
        activation of that, `silu_and_mul`): beside it on a second stream where the context
        says so (added in the activation's launch, or by `add_lora_beside`, which with
        `sums_out` redoes the sums of squares `base()` wrote), else after it."""
        if self.runs_beside(name, x):
            if gated:
                return silu_and_mul(*self.apart(name, x, base, sumsq, eps))
            step, stack = self.context.step, self.stacks[name]
            assert step is not None
            return add_lora_beside(base, x, stack.a, stack.b, step.mask, stack.out_parts, sumsq,
                                   eps, sums_out)  # fmt: skip
        y = self.add(name, x, base(), sumsq, eps)
        return silu_and_mul(y) if gated else y

    def _beside(self, x: torch.Tensor) -> bool:
        return self.context.products == "beside" and x.is_cuda

    def runs_beside(self, name: str, x: torch.Tensor) -> bool:
        """Whether `name`'s products of x's rows run beside its base GEMM in this step, so
        that `apart` gives them for a later kernel to add (q/k/v's: the rotary kernel)."""
        return self.active and name in self.stacks and self._beside(x)

    def apart(
        self, name: str, x: torch.Tensor, base: Callable[[], torch.Tensor],
        sumsq: torch.Tensor | None = None, eps: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`base()` and, not yet added, `name`'s products of x's rows (`lora_beside`), where
        `runs_beside`."""
        step, stack = self.context.step, self.stacks[name]
        assert step is not None
        return lora_beside(base, x, stack.a, stack.b, step.mask, stack.out_parts, sumsq, eps)

    def shrunk(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, gated: bool = False
    ) -> ShrunkRows | None:
        """x's rows shrunk by `name`'s adapters for the skinny GEMM of `weight` to expand in its
        epilogue (one launch here, none after the GEMM), where that GEMM takes them
        (`skinny_gemm.lora_fits`); else None."""
        step, stack = self.context.step, self.stacks.get(name)
        if step is None or stack is None or not x.is_cuda or self.context.products != "epilogue":
            return None
        from workers.kernels import lora_sgmv, skinny_gemm  # Triton: imported on first CUDA use

        if not skinny_gemm.lora_fits(x.shape[0], weight, stack.out_parts, gated):
            return None
        return lora_sgmv.shrunk_rows(x, stack.a, stack.b, step.mask, stack.out_parts)

    def residual_linear(
        self, name: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        sum_out: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """`residual_linear(x, weight, residual, sum_out)` plus `name`'s products of x's rows:
        in the GEMM's epilogue where it takes them; beside it on a second stream, added after
        it with `sum_out` redone (their launches then off the path between the attention or
        the activation and the GEMM); else into `residual` before it."""
        if (shrunk := self.shrunk(name, x, weight)) is not None:
            return residual_linear(x, weight, residual, sum_out, shrunk)
        if self._beside(x):
            base = functools.partial(residual_linear, x, weight, residual, sum_out)
            return self.linear(name, x, base, sums_out=sum_out)
        return residual_linear(x, weight, self.add(name, x, residual), sum_out)

    def rms_linear(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        norm: RMSNorm, sumsq: torch.Tensor | None, gated: bool = False,
        shrunk: ShrunkRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`rms_linear(x, weight, bias, norm, sumsq, gated)` plus `name`'s products of the same
        normed rows (before the activation): in the GEMM's epilogue given `shrunk` (the
        caller's `shrunk` of x's rows), else of x scaled by 1/rms where `sumsq` holds its sums
        of squares, else of `norm(x)`, run once for both."""
        if shrunk is not None:
            return rms_linear(x, weight, bias, norm, sumsq, gated, shrunk)
        rows, base, sumsq, eps = _normed_rows(x, weight, bias, norm, sumsq)
        return self.linear(name, rows, base, sumsq, eps, gated=gated)

    def rms_linear_apart(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        norm: RMSNorm, sumsq: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`rms_linear`'s base product and, apart (`apart`), `name`'s products of the same
        normed rows, where `runs_beside`."""
        return self.apart(name, *_normed_rows(x, weight, bias, norm, sumsq))


def _normed_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: RMSNorm,
    sumsq: torch.Tensor | None,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor], torch.Tensor | None, float]:  # fmt: skip
    """What LoRA multiplies for `rms_linear(x, weight, bias, norm, sumsq)`, and how: the rows
    (x, scaled by 1/rms where `sumsq` holds its sums of squares, else `norm(x)`, run once for
    both products), the base product of them, and the sums and eps that scale them."""
    if sumsq is None:
        h = norm(x)
        return h, lambda: linear(h, weight, bias), None, 0.0
    return x, functools.partial(rms_linear, x, weight, bias, norm, sumsq), sumsq, norm.eps
