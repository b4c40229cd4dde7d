"""The experts of a sparse MoE layer, stacked: `w13` [E, 2I, H] (each expert's gate rows, then its
up rows) and `w2` [E, H, I], so one kernel reads any expert by index.

Placement over a tensor-parallel group of n ranks:
- tensor parallel (default): every rank holds every expert, each split as a dense MLP is (its
  I/n rows of gate and up, the same I/n columns of down); the ranks' outputs are partial sums.
- expert parallel (`EngineConfig.expert_parallel`): rank r holds whole experts
  [r E/n, (r+1) E/n) and computes their contributions for all of the step's tokens (every rank
  has every token: attention is tensor parallel); the other experts' contributions are 0 here.
In both, the layer's output on a rank is a partial sum that the next norm's all-reduce
completes (`RMSNorm.add_forward`), as for a dense MLP.
"""

from __future__ import annotations

import re
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel.group import TPGroup

# HF per-expert tensor names: Qwen3-MoE's (and Qwen2-MoE's) and Mixtral's
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# transformers 5's own stacked tensors (what its state_dict holds, e.g. a GGUF file dequantised
# through it): gate_up_proj [E, 2I, H], down_proj [E, H, I]
_STACKED_NAME = re.compile(r"^(?P<prefix>.*\.)mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_PROJ_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
              "down_proj": "down", "w2": "down"}  # fmt: skip
KINDS = ("gate", "up", "down")
ALL = -1  # the expert id of a stacked tensor: every expert


def expert_weight(name: str) -> tuple[str, tuple[int, str]] | None:
    """A checkpoint's expert tensor name -> (our stacked parameter, (expert or ALL, kind));
    None for other tensors."""
    if (stacked := _STACKED_NAME.match(name)) is not None:
        gate_up = stacked["proj"] == "gate_up_proj"
        param, kind = ("w13", "gate_up") if gate_up else ("w2", "down")
        return f"{stacked['prefix']}mlp.experts.{param}", (ALL, kind)
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    kind = _PROJ_KIND[m["proj"]]
    param = "w2" if kind == "down" else "w13"
    return f"{m['prefix']}mlp.experts.{param}", (int(m["expert"]), kind)


def moe_param_name(name: str) -> str:
    """Mixtral's `block_sparse_moe.gate` is our `mlp.gate` (the MoE block sits in the MLP slot)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class StackedExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, expert_parallel: bool
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            self.local = tp.shard(num_experts, "num_experts (expert_parallel)")
            self.first, self.inter, self.col = tp.rank * self.local, intermediate, 0
        else:
            self.local, self.first = num_experts, 0
            self.inter = tp.shard(intermediate, "moe_intermediate_size")
            self.col = tp.rank * self.inter  # this rank's slice of each expert's I
        self.w13 = self._param((self.local, 2 * self.inter, hidden))
        self.w2 = self._param((self.local, hidden, self.inter))
        self._seen: set[tuple[int, str]] = set()

    def _param(self, shape: tuple[int, ...]) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape), requires_grad=False)
        p.weight_loader = self._load  # type: ignore[attr-defined]
        return p

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's part of one expert's gate, up or down matrix (`shard_id`: (expert,
        kind)); an expert another rank holds is only noted as seen."""
        expert, kind = cast(tuple[int, str], shard_id)
        if expert == ALL:  # a stacked tensor: each expert's matrices in turn
            if weight.shape[0] != self.num_experts:
                raise ValueError(f"{kind}: {weight.shape[0]} experts, the model has "
                                 f"{self.num_experts}")  # fmt: skip
            inter = weight.shape[1] // 2 if kind == "gate_up" else weight.shape[2]
            for e in range(self.num_experts):
                if kind == "down":
                    self._load(param, weight[e], (e, "down"))
                else:
                    self._load(param, weight[e, :inter], (e, "gate"))
                    self._load(param, weight[e, inter:], (e, "up"))
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside the model's {self.num_experts} experts")
        self._seen.add((expert, kind))
        e = expert - self.first
        if not 0 <= e < self.local:
            return
        if kind == "down":
            dst, src = param.data[e], weight.narrow(1, self.col, self.inter)
        else:
            dst = param.data[e].narrow(0, 0 if kind == "gate" else self.inter, self.inter)
            src = weight.narrow(0, self.col, self.inter)
        if dst.shape != src.shape:
            raise ValueError(f"expert {expert} {kind}: checkpoint {tuple(src.shape)} != "
                             f"parameter slice {tuple(dst.shape)}")  # fmt: skip
        dst.copy_(src)

    def check_loaded(self, where: str) -> None:
        """Refuse a checkpoint that lacks any expert's gate, up or down matrix."""
        missing = [(e, k) for e in range(self.num_experts) for k in KINDS
                   if (e, k) not in self._seen]  # fmt: skip
        if missing:
            shown = ", ".join(f"expert {e} {k}" for e, k in missing[:4])
            raise ValueError(f"checkpoint lacks {where}: {shown} ({len(missing)} expert weights)")

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weight_k * expert_{id_k}(x) over this rank's experts (and its I slice) for each
        row of x `[T, H]`; `topk_ids` / `topk_weights` `[T, k]` name global experts."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            # Triton: imported on first CUDA use (float32 keeps torch's exact GEMMs, not TF32)
            from workers.kernels.moe_fused import fused_moe

            w13, w2, first = self.w13, self.w2, self.first
            return fused_moe(x, w13, w2, topk_weights, topk_ids, first, self.num_experts)
        return grouped_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.first)


def grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, first: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The torch path: the (token, slot) pairs sorted by expert, one pair of GEMMs per expert
    that has tokens (decode touches only the routed experts), outputs weighted and added back
    into their tokens' rows. Experts outside [first, first + E_local) are another rank's."""
    out = torch.zeros_like(x)
    num_local, k = w13.shape[0], topk_ids.shape[1]
    local = topk_ids.flatten() - first
    local = local.masked_fill((local < 0) | (local >= num_local), num_local)  # others' last
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start : start + n]
            rows = pairs // k
            gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            out.index_add_(0, rows, y * topk_weights.flatten()[pairs, None].to(y.dtype))
        start += n
    return out
