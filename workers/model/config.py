"""The model's shape, normalised from a HF `config.json` for the Llama family we implement."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# config.json fields pdserve needs and gives no default
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "max_position_embeddings")


class UnsupportedModelError(ValueError):
    pass


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (workers/model/moe.py); num_experts 0: every layer a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # a gated dense MLP beside the experts (Qwen2-MoE)
    decoder_sparse_step: int = 1  # every step-th layer is sparse (those not in mlp_only_layers)
    mlp_only_layers: tuple[int, ...] = ()
    # How this process places experts (EngineConfig.expert_parallel), not the checkpoint's
    expert_parallel: bool = False

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` runs a sparse MoE block (HF's rule for Qwen3-MoE)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def context_limit(self, requested: int | None = None) -> int:
        """Longest sequence served: the model's, capped by a sliding window we don't implement
        and by `requested` (which may not exceed it)."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None and self.sliding_window < limit:
            logger.warning(
                "sliding-window attention is not implemented: context capped at %d",
                self.sliding_window,
            )
            limit = self.sliding_window
        if requested is not None:
            if requested > limit:
                raise ValueError(f"max_model_len={requested} exceeds the model's {limit}")
            limit = requested
        return limit

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a checkpoint's config.json, with the defaults of the families' transformers
        config classes for the fields a config.json may leave out."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type', '?')}; "
                f"pdserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = hf["num_attention_heads"]
        # Qwen's config classes default to no sliding window; Mistral's has no switch
        qwen = family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
        windowed = hf.get("use_sliding_window", not qwen)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(family, hf),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=hf.get("sliding_window") if windowed else None,
            eos_token_ids=eos_ids,
            **_moe_fields(family, hf),
        )


def _attention_bias(family: str, hf: dict[str, Any]) -> bool:
    """Whether q/k/v have biases: Qwen2's always, Qwen2-MoE's unless `qkv_bias` says not."""
    if family == "qwen2":
        return True
    if family == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _moe_fields(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The routing fields of an MoE family's config.json, with its config class's defaults."""
    # transformers 5 writes either family's expert count as num_local_experts
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if family == "mixtral":  # every layer sparse; top-k weights always renormalised
        return dict(
            num_experts=experts or 8,
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
        )
    if family in ("qwen2_moe", "qwen3_moe"):
        qwen2 = family == "qwen2_moe"
        shared = hf.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
        return dict(
            num_experts=experts or (60 if qwen2 else 128),
            num_experts_per_tok=hf.get("num_experts_per_tok", 4 if qwen2 else 8),
            moe_intermediate_size=hf.get("moe_intermediate_size", 1408 if qwen2 else 768),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=shared,
        )
    return {}
