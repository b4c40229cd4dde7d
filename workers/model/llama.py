"""The Llama family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over paged KV.

Module names mirror HF checkpoints so weight names map one to one, except the fused projections
(`qkv_proj` from q/k/v_proj, `gate_up_proj` from gate/up_proj): `weight_names.STACKED_PARAMS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from workers.attention.base import AttentionBackend
from workers.attention.rotary import RotaryEmbedding
from workers.kvcache.kv_dtype import is_kv_scale
from workers.model.config import ModelConfig
from workers.model.layers import (
    ParallelLMHead,
    RMSNorm,
    VocabParallelEmbedding,
    skinny_takes_all,
)
from workers.model.llama_attention import Attention
from workers.model.mlp import MLP
from workers.model.moe import SparseMoeBlock
from workers.model.moe_experts import StackedExperts
from workers.model.weight_names import param_name
from workers.parallel.group import TPGroup


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, tp) if cfg.is_sparse_layer(layer_id) else MLP(cfg, tp)
        )

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

    def forward_folded(
        self, residual: torch.Tensor, sums: list[torch.Tensor | None],
        cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """The residual stream after this layer, its norms' gains folded into the weights that
        read them: on CUDA four skinny GEMM launches and attention, no norm or add kernel.
        `sums` (`rms_linear`): the float64 sums of squares of the stream's rows coming in, and
        zeros for those after attention and going out; a None instead runs that norm itself
        (off CUDA; the last layer's output, which the final norm reads)."""
        s_in, s_mid, s_out = sums
        attn_norm, mlp_norm = self.input_layernorm, self.post_attention_layernorm
        residual = self.self_attn.forward_folded(residual, attn_norm, s_in, s_mid, cos_sin, attn)
        return cast(MLP, self.mlp).forward_folded(residual, mlp_norm, s_mid, s_out)  # dense only

    def folded_weights(self) -> list[torch.Tensor]:
        """The weights `forward_folded` multiplies, in its order."""
        attn, mlp = self.self_attn, cast(MLP, self.mlp)  # folding: dense models only
        return [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight]  # fmt: skip


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, fold_norms: bool = True) -> None:
        """`fold_norms` (`KernelConfig.fold_norms`): fold the norm gains at load where it pays
        (`_folding_pays`)."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp = tp
        self.fold_norms = fold_norms
        self.norms_folded = False  # see fold_norm_gains
        # each layer's (input, post-attention) norm gains as they were before folding
        self.folded_gains: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    @property
    def attention(self) -> Attention:
        return self.model.layers[0].self_attn  # type: ignore[return-value]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Packed tokens `[T]` -> final hidden states `[T, hidden]`."""
        if self.norms_folded and self._folded_forward_runs(input_ids):
            return self._forward_folded(input_ids, positions, attn)
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos_sin, attn)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm.add_forward(x, residual, self.tp)[0]

    def _forward_folded(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """`forward` with the norms inside the GEMMs (`fold_norm_gains`): on CUDA the embedding
        and each GEMM that ends a half-layer leave the float64 sums of squares of the new
        stream's rows in a slice of one buffer, which the next GEMM's norm reads."""
        layers = self.decoder_layers
        # Entry 0: the embedding rows, 2i + 1: the stream after layer i's attention, 2i + 2:
        # after its MLP; None for the last layer's output (the final norm runs as a kernel)
        # and off CUDA (every norm a kernel).
        sums: list[torch.Tensor | None] = [None] * (2 * len(layers) + 1)
        cos_sin: tuple[torch.Tensor, ...]
        if input_ids.is_cuda:
            from workers.kernels.step_inputs import step_inputs

            x, buffer, cos_sin = step_inputs(
                input_ids, positions, self.model.embed_tokens.weight, self.rotary.inv_freq,
                2 * len(layers),
            )  # fmt: skip
            sums[:-1] = list(buffer)
        else:
            x = self.model.embed_tokens(input_ids)
            cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual = x
        for i, layer in enumerate(layers):
            residual = layer.forward_folded(residual, sums[2 * i : 2 * i + 3], cos_sin, attn)
        return self.model.norm(residual)

    def _folded_forward_runs(self, input_ids: torch.Tensor) -> bool:
        """Whether the folded layers take these tokens' rows: on CUDA where the skinny GEMM runs
        each of a layer's weights (elsewhere the norm kernels run, their gains 1 after
        folding); off CUDA always, in torch (tests)."""
        return not input_ids.is_cuda or self._skinny_runs_every_weight(input_ids.shape[0])

    def _skinny_runs_every_weight(self, rows: int) -> bool:
        """Whether the skinny GEMM takes `rows` rows of the hidden stream times each weight of
        a layer (asked with a view of the embedding table: the stream's shape, dtype, device)."""
        x = self.model.embed_tokens.weight[:1].expand(rows, -1)
        return skinny_takes_all(x, self.decoder_layers[0].folded_weights())

    def fold_norm_gains(self) -> None:
        """Multiply each layer's input and post-attention RMSNorm gains into the columns of the
        weights that read the norms (q/k/v, gate/up) and make the gains 1: the same products,
        the norm now a scale the GEMM applies (`_forward_folded`). In 16 bits the folded weights
        round once more (relative 2^-9 at most, as the normed activations did)."""
        for layer in self.decoder_layers:
            gains = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self.folded_gains.append((gains[0].clone(), gains[1].clone()))
            pairs = [
                (layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight),
                (layer.post_attention_layernorm.weight, cast(MLP, layer.mlp).gate_up_proj.weight),
            ]
            for gain, weight in pairs:
                weight.data.copy_(weight.data.float() * gain.data.float()[None, :])
                gain.data.fill_(1.0)
        self.norms_folded = True

    def _folding_pays(self) -> bool:
        """One rank, and the skinny GEMM runs every weight of a batch-1 decode step: where
        folding removes the norm kernels (`fold_norms=False` keeps them, for comparison)."""
        if self.tp.size != 1 or not self.fold_norms or self.config.num_experts:
            return False  # MoE layers keep their norms: the router and experts read one input
        return self._skinny_runs_every_weight(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)  # float32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or is_kv_scale(name):  # KV scales: the KV pool's
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = param_name(name)
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
        for where, module in self.named_modules():
            if isinstance(module, StackedExperts):
                module.check_loaded(where)
        if self._folding_pays():
            self.fold_norm_gains()
