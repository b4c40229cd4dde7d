"""Random weights for a model known only by its config (`load_format="dummy"`): benchmarks.

The values follow HF's initialisation in spirit (normal(0, 0.02) matrices, unit norm weights,
zero biases), so activations and logits stay finite and ordinary in bf16. Every rank draws the
same full tensors from one seed and keeps its shard, exactly as a checkpoint would load.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from workers.model.config import ModelConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.weight_names import STACKED_PARAMS
from workers.parallel.group import TPGroup

INIT_STD = 0.02


def _checkpoint_shapes(model: LlamaForCausalLM) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names and full (unsharded) shapes of the tensors a HF checkpoint of `model` holds."""
    cfg = model.config
    d, hidden = cfg.head_dim, cfg.hidden_size
    fused_shapes = {
        ".q_proj.": cfg.num_heads * d,
        ".k_proj.": cfg.num_kv_heads * d,
        ".v_proj.": cfg.num_kv_heads * d,
        ".gate_proj.": cfg.intermediate_size,
        ".up_proj.": cfg.intermediate_size,
    }
    for name, param in model.named_parameters():
        if name.endswith(".experts.w13") or name.endswith(".experts.w2"):
            yield from _expert_shapes(name, cfg)
        elif ".qkv_proj." in name or ".gate_up_proj." in name:
            for src, (dst, _) in STACKED_PARAMS.items():
                if dst in name:
                    rows = fused_shapes[src]
                    shape = (rows, hidden) if name.endswith("weight") else (rows,)
                    yield name.replace(dst, src), shape
        elif name.endswith("o_proj.weight"):
            yield name, (hidden, cfg.num_heads * d)
        elif name.endswith("down_proj.weight"):
            yield name, (hidden, cfg.intermediate_size)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            yield name, (cfg.vocab_size, hidden)
        else:  # norms and biases are replicated: the parameter's shape is the full shape
            yield name, tuple(param.shape)


def _expert_shapes(name: str, cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The per-expert HF tensors (Qwen3-MoE's names) a stacked expert parameter loads from."""
    prefix, inter, hidden = name.rsplit(".", 1)[0], cfg.moe_intermediate_size, cfg.hidden_size
    projs = ("down_proj",) if name.endswith("w2") else ("gate_proj", "up_proj")
    for e in range(cfg.num_experts):
        for proj in projs:
            shape = (hidden, inter) if proj == "down_proj" else (inter, hidden)
            yield f"{prefix}.{e}.{proj}.weight", shape


def load_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Fill every parameter of `model` with seeded random values, shard by shard."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator(device).manual_seed(seed)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in _checkpoint_shapes(model):
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=dtype, device=device)
            elif len(shape) == 1:
                yield name, torch.zeros(shape, dtype=dtype, device=device)
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
                yield name, t.normal_(0.0, INIT_STD, generator=gen)

    model.load_weights(tensors())


def build_dummy_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup, seed: int = 0,
    fold_norms: bool = True,
) -> LlamaForCausalLM:
    """`LlamaForCausalLM` for `cfg` on `device` in `dtype`, with seeded random weights
    (`fold_norms`: `LlamaForCausalLM`'s)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, tp, fold_norms)
    finally:
        torch.set_default_dtype(old)
    load_dummy_weights(model, seed)
    return model.eval()
