"""The Llama family's dense SwiGLU MLP (gate/up, then down): a dense layer's MLP slot, and the
shared expert beside an MoE block's routed experts (`moe.SparseMoeBlock`), on the plain and on
the folded path, with the LoRA hook (`LayerLoRA`) of its two projections."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    residual_linear,
    rms_linear,
    silu_and_mul_linear,
)
from workers.model.lora_layers import LayerLoRA
from workers.parallel.group import TPGroup


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate: int | None = None) -> None:
        """`intermediate`: its size where not the model's dense one (an MoE's shared expert)."""
        super().__init__()
        size = intermediate or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], False, tp)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp)
        self.lora: LayerLoRA | None = None  # set where LoRA is enabled (workers/lora/slots.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum: the next norm sums it over the group."""
        if self.lora is not None and self.lora.active:
            lora = self.lora
            act = lora.linear("gate_up", x, lambda: self.gate_up_proj(x), gated=True)
            return lora.linear("down", act, lambda: self.down_proj(act, reduce=False))
        return self.down_proj(silu_and_mul_linear(x, self.gate_up_proj.weight), reduce=False)

    def forward_folded(
        self, residual: torch.Tensor, norm: RMSNorm, sum_in: torch.Tensor | None,
        sum_out: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """`residual + MLP(norm(residual))`, as `Attention.forward_folded`."""
        w = self.gate_up_proj.weight
        lora = self.lora if self.lora is not None and self.lora.active else None
        if lora is None:
            act = rms_linear(residual, w, None, norm, sum_in, gated=True)
            return residual_linear(act, self.down_proj.weight, residual, sum_out)
        # LoRA adds to gate and up before the activation, and down's to the stream
        shrunk = lora.shrunk("gate_up", residual, w, True) if sum_in is not None else None
        act = lora.rms_linear("gate_up", residual, w, None, norm, sum_in, True, shrunk)
        return lora.residual_linear("down", act, residual, self.down_proj.weight, sum_out)
