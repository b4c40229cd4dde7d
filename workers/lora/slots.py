"""Device slots of LoRA weights: per layer and projection, the A and B of every resident adapter
stacked along a slot axis (`ProjectionStack`), zero where an adapter has no such module or a
smaller rank than the slots' width.

Under tensor parallelism each rank keeps its share, split as the base weight is and by the base
layers' own loaders: a column-parallel projection's B by output rows (its A whole), a
row-parallel one's A by input columns (its B whole; the partial products add into the partial
sums the all-reduce after them sums). Where the norm gains were folded into q/k/v and gate/up
(`LlamaForCausalLM.fold_norm_gains`) a LoRA step still reads the normed rows with gain 1, so
the gains go into those A's columns too.
"""

from __future__ import annotations

from typing import cast

import torch

from workers.lora.adapter import LoRAAdapter, LoRAAdapterError
from workers.model.llama import LlamaForCausalLM
from workers.model.lora_layers import LayerLoRA, LoRAContext, ProjectionStack
from workers.model.mlp import MLP

# our projection -> (its PEFT modules with their shard ids in the base loader, row-parallel?)
PROJECTIONS: dict[str, tuple[tuple[tuple[str, int | str | None], ...], bool]] = {
    "qkv": ((("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")), False),
    "o": ((("o_proj", None),), True),
    "gate_up": ((("gate_proj", 0), ("up_proj", 1)), False),
    "down": ((("down_proj", None),), True),
}
ATTENTION, MLP_PROJECTIONS = ("qkv", "o"), ("gate_up", "down")


class LoRASlots:
    def __init__(
        self, model: LlamaForCausalLM, num_slots: int, max_rank: int, products: str = "after"
    ) -> None:
        self.model = model
        self.num_slots = num_slots
        self.rank = max_rank
        self.context = LoRAContext(products)
        weight = model.decoder_layers[0].self_attn.o_proj.weight
        dtype, device = weight.dtype, weight.device
        self.dtype = dtype  # the stacks' and each step's slot mask's
        self.layers: list[dict[str, ProjectionStack]] = []
        for layer in model.decoder_layers:
            stacks = {}
            modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj}
            if isinstance(layer.mlp, MLP):  # LoRA on MoE experts is not supported
                modules.update(gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj)
            for name, proj in modules.items():
                parts, row_parallel = len(PROJECTIONS[name][0]), PROJECTIONS[name][1]
                out, n_in = cast(torch.Tensor, proj.weight).shape
                sizes: list[int] = getattr(proj, "shard_sizes", [out])
                out_parts = [out] if row_parallel else list(sizes)
                a = torch.zeros(num_slots, parts * max_rank, n_in, dtype=dtype, device=device)
                b = torch.zeros(out, num_slots, max_rank, dtype=dtype, device=device)
                stacks[name] = ProjectionStack(a, b, out_parts)
            self.layers.append(stacks)
            layer.self_attn.lora = LayerLoRA(self.context, {k: stacks[k] for k in ATTENTION})
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora = LayerLoRA(self.context, {k: stacks[k] for k in MLP_PROJECTIONS})

    def check(self, adapter: LoRAAdapter) -> None:
        """Refuse an adapter on modules this model has no slots for (MoE experts' MLPs)."""
        for layer, module in adapter.weights:
            name = next(n for n, (mods, _) in PROJECTIONS.items() if module in dict(mods))
            if name not in self.layers[layer]:
                raise LoRAAdapterError(
                    f"LoRA adapter {adapter.request.lora_name!r} targets {module} of layer "
                    f"{layer}, an MoE layer: LoRA on MoE experts is not supported"
                )

    @torch.inference_mode()
    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (zeroing what it leaves out)."""
        self.check(adapter)
        r = adapter.rank
        layers = self.model.decoder_layers
        for i, stacks in enumerate(self.layers):
            for name, stack in stacks.items():
                stack.a[slot].zero_()
                stack.b[:, slot].zero_()
                mods, row_parallel = PROJECTIONS[name]
                proj = _projection(layers[i], name)
                for p, (module, shard) in enumerate(mods):
                    ab = adapter.weights.get((i, module))
                    if ab is None:
                        continue
                    a, b = ab
                    if row_parallel:  # A split by input columns as the base weight is
                        proj._load(stack.a[slot, :r], a.to(stack.a.dtype))  # type: ignore[operator]
                        stack.b[:, slot, :r].copy_(b)
                        continue
                    if self.model.norms_folded:
                        a = a * self.model.folded_gains[i][0 if name == "qkv" else 1].float().cpu()
                    stack.a[slot, p * self.rank : p * self.rank + r].copy_(a)
                    # B split by output rows, into this part's rows of the stack
                    proj._load(stack.b[:, slot, :r], b.to(stack.b.dtype), shard)  # type: ignore[operator]

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for stacks in self.layers:
            for stack in stacks.values():
                stack.a[slot].zero_()
                stack.b[:, slot].zero_()

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for stacks in self.layers for s in stacks.values())


def _projection(layer: torch.nn.Module, name: str) -> torch.nn.Module:
    owner = layer.self_attn if name in ATTENTION else layer.mlp
    return getattr(owner, {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj",
                           "down": "down_proj"}[name])  # fmt: skip
