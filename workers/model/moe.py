"""A sparse mixture-of-experts block, in a decoder layer's MLP slot (`DecoderLayer.mlp`).

A router (a linear layer to one logit per expert) picks each token's top-k experts by softmax
probability; the token's output is the sum of those experts' SwiGLU MLPs weighted by their
probabilities, renormalised over the k chosen where the family says so (`norm_topk_prob`:
Qwen3-MoE's flag, always for Mixtral). Experts: `moe_experts.StackedExperts`.

A shared expert (Qwen2-MoE's `shared_expert_intermediate_size`): a dense `MLP` beside the
experts, split over the ranks as a dense MLP is, its output times the sigmoid of its own gate
(`shared_expert_gate`, one logit a token, replicated) added to the routed sum. DeepSeek's shared
experts are the same without the gate.

Families this block is meant to take next, without a second MoE module: grouped routing
(DeepSeek-V3): `Router.forward` is the only place that turns logits into (weights, ids); a
sigmoid score, a bias for selection only and a top-groups mask go there.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels.norms import HALF_DTYPES
from workers.model.config import ModelConfig
from workers.model.layers import replicated_loader
from workers.model.mlp import MLP
from workers.model.moe_experts import StackedExperts
from workers.parallel.group import TPGroup


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        # every rank routes every token: the router is replicated
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.weight.weight_loader = replicated_loader  # type: ignore[attr-defined]
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k (weights in float32, expert ids), softmax in float32 as HF does."""
        if x.is_cuda:
            from workers.kernels import moe_route  # Triton: first CUDA use

            if x.dtype in HALF_DTYPES and x.shape[0] <= moe_route.FUSED_MAX_TOKENS:
                # the router GEMM too in the one launch (float32 stays on torch.mm's sums)
                return moe_route.route_fused(x, self.weight, self.top_k, self.renormalize)
        # logits in the model's dtype, softmax in float32 (as HF)
        logits = torch.mm(x, self.weight.t())
        if logits.is_cuda:  # one launch for the softmax, top-k and renormalisation
            from workers.kernels.moe_route import route_top_k

            return route_top_k(logits, self.top_k, self.renormalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class SparseMoeBlock(nn.Module):
    routed_tokens: torch.Tensor

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate = Router(
            cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        self.experts = StackedExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp, cfg.expert_parallel
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, tp, cfg.shared_expert_intermediate_size)
            gate = nn.Linear(cfg.hidden_size, 1, bias=False).requires_grad_(False)
            gate.weight.weight_loader = replicated_loader  # type: ignore[attr-defined]
            self.shared_expert_gate = gate  # one logit a token: every rank computes it
        # (token, expert) pairs routed to each expert by eager forwards (`routed_token_counts`)
        counts = torch.zeros(cfg.num_experts, dtype=torch.long)
        self.register_buffer("routed_tokens", counts, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the block's output (its experts, or its slice of every
        expert): the next norm sums it over the group, as for a dense MLP."""
        weights, ids = self.gate(x)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            # A decode graph's replays are not counted: its padding rows would count too
            flat = ids.flatten()
            self.routed_tokens.index_add_(0, flat, torch.ones_like(flat))
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1], as HF
            out = out + gate * self.shared_expert(x)
        return out


def routed_token_counts(model: nn.Module) -> dict[str, list[int]]:
    """Per sparse layer (its index), the tokens routed to each expert so far by the forwards
    that ran eagerly: every prefill chunk, and decode steps outside the CUDA graphs (all steps
    on the CPU): a sample of the routing, read on the host (one wait for the device)."""
    return {
        name.split(".")[-2]: block.routed_tokens.tolist()
        for name, block in model.named_modules()
        if isinstance(block, SparseMoeBlock)
    }


def reset_routed_token_counts(model: nn.Module) -> None:
    """Forget what warm-up forwards routed (the CUDA graphs' before their capture)."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block.routed_tokens.zero_()
