"""Checkpoint tensor names -> this package's parameter names and the shard each tensor fills."""

from __future__ import annotations

from workers.model.moe_experts import expert_weight, moe_param_name

# checkpoint name fragment -> (our fragment, shard id)
STACKED_PARAMS: dict[str, tuple[str, int | str]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def param_name(name: str) -> tuple[str, int | str | tuple[int, str] | None]:
    """A checkpoint tensor's parameter name and shard id (None: the whole parameter): fused
    projections take their parts as shards, an MoE expert its row of the stacked experts."""
    name, expert = moe_param_name(name), expert_weight(name)
    if expert is not None:
        return expert
    for src, (dst, shard_id) in STACKED_PARAMS.items():
        if src in name:
            return name.replace(src, dst), shard_id
    return name, None
