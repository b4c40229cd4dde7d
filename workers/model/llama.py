"""The Llama family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over paged KV.

Module names mirror HF checkpoints so weight names map one to one, except the fused projections
(`qkv_proj` from q/k/v_proj, `gate_up_proj` from gate/up_proj), listed in `STACKED_PARAMS`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workers.attention.base import AttentionBackend
from workers.model.config import ModelConfig
from workers.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    silu_and_mul_linear,
)
from workers.model.rotary import RotaryEmbedding, apply_rotary
from workers.tp import TPGroup

# checkpoint name fragment -> (our fragment, shard id)
STACKED_PARAMS: dict[str, tuple[str, int | str]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        # A backend that writes K/V itself may rotate q and k in that same kernel (FlashInfer on
        # CUDA: `forward_rotary`); the others are given rotated q and k.
        forward_rotary = getattr(attn, "forward_rotary", None)
        if forward_rotary is not None:
            out = forward_rotary(self.layer_id, q, k, v, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = attn.forward(self.layer_id, q, k, v)
        # This rank's partial sum: the norm after attention sums it over the group.
        return self.o_proj(out.reshape(x.shape[0], -1), reduce=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], False, tp)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum: the next norm sums it over the group."""
        return self.down_proj(silu_and_mul_linear(x, self.gate_up_proj.weight), reduce=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, ...],
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `residual + x` (just `x` at the first layer, `residual=None`).
        Returns the MLP's output and the stream before it, not yet added: the next norm adds
        them in its own kernel (`RMSNorm.add_forward`), so no layer launches a separate add.
        Under tensor parallelism that output is this rank's partial sum, and the norm's add also
        sums it over the group (with attention's likewise)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, self.tp)
        h = self.self_attn(h, cos_sin, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, self.tp)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp = tp

    @property
    def attention(self) -> Attention:
        return self.model.layers[0].self_attn  # type: ignore[return-value]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Packed tokens `[T]` -> final hidden states `[T, hidden]`."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos_sin, attn)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm.add_forward(x, residual, self.tp)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)  # float32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard: int | str | None = None
            for src, (dst, shard_id) in STACKED_PARAMS.items():
                if src in name:
                    name, shard = name.replace(src, dst), shard_id
                    break
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[name]
            param.weight_loader(param, tensor.to(param.dtype), shard)  # type: ignore[attr-defined]
            loaded.add(name)
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = set(params) - loaded - tied
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
