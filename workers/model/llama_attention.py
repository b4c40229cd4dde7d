"""The Llama family's self-attention over paged KV (q/k/v and o projections, the rotary
embedding, Qwen3's q/k norms), on the plain and on the folded path (`LlamaForCausalLM`'s
`fold_norm_gains`), with the LoRA hook (`LayerLoRA`) of its two projections."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.attention.base import AttentionBackend
from workers.attention.rotary import apply_rotary
from workers.kernels.norms import QKNorm
from workers.model.config import ModelConfig
from workers.model.layers import (
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    residual_linear,
    rms_linear,
    rms_linear_rotary,
)
from workers.model.lora_layers import LayerLoRA
from workers.parallel.group import TPGroup

if TYPE_CHECKING:
    from workers.kernels.rope import RotaryStore  # Triton: CUDA backends give it


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
        self.lora: LayerLoRA | None = None  # set where LoRA is enabled (workers/lora/slots.py)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend
    ) -> torch.Tensor:
        # This rank's partial sum: the norm after attention sums it over the group.
        if self.lora is not None and self.lora.active:
            lora = self.lora

            def base() -> torch.Tensor:
                return self.qkv_proj(x)

            if (store := self.lora_store(lora, x, cos_sin, attn)) is not None:
                out = self.attend_added(store, *lora.apart("qkv", x, base), attn)
            else:
                out = self.attend(lora.linear("qkv", x, base), cos_sin, attn)
            return lora.linear("o", out, lambda: self.o_proj(out, reduce=False))
        return self.o_proj(self.attend(self.qkv_proj(x), cos_sin, attn), reduce=False)

    def forward_folded(
        self, residual: torch.Tensor, norm: RMSNorm, sum_in: torch.Tensor | None,
        sum_out: torch.Tensor | None, cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        """`residual + attention(norm(residual))` with `norm`'s gain folded into q/k/v
        (`LlamaForCausalLM.fold_norm_gains`); `sum_in`: the sums of squares of `residual`'s
        rows, `sum_out`: zeros to add the result's into (see `rms_linear`). Where the backend
        lets the q/k/v GEMM rotate and write K/V itself (`rotary_store`), no tensor of q/k/v
        and no rotary kernel come between the GEMM and the attention."""
        w, bias = self.qkv_proj.weight, self.qkv_proj.bias
        lora = self.lora if self.lora is not None and self.lora.active else None
        # LoRA adds to q/k/v before rotary: in the GEMM's epilogue (`shrunk`), else after it
        shrunk = lora.shrunk("qkv", residual, w) if lora and sum_in is not None else None
        # Qwen3's q/k norms need a head's whole row, which the epilogue's tiles may split: they
        # go to `forward_rotary`'s kernel instead (`attend`).
        rotate_in_gemm = self.q_norm is None and (lora is None or shrunk is not None)
        store = attn.rotary_store(self.layer_id, *cos_sin) if rotate_in_gemm else None
        q = rms_linear_rotary(residual, w, bias, norm, sum_in, store, shrunk)
        if q is not None:
            q = q.view(-1, self.num_heads, self.head_dim)
            out = attn.attend_rotated(self.layer_id, q).reshape(q.shape[0], -1)
        elif lora and (store := self.lora_store(lora, residual, cos_sin, attn)) is not None:
            apart = lora.rms_linear_apart("qkv", residual, w, bias, norm, sum_in)
            out = self.attend_added(store, *apart, attn)
        else:
            if lora is None:
                qkv = rms_linear(residual, w, bias, norm, sum_in)
            else:
                qkv = lora.rms_linear("qkv", residual, w, bias, norm, sum_in, shrunk=shrunk)
            out = self.attend(qkv, cos_sin, attn)
        if lora:
            return lora.residual_linear("o", out, residual, self.o_proj.weight, sum_out)
        return residual_linear(out, self.o_proj.weight, residual, sum_out)

    def lora_store(
        self, lora: LayerLoRA, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...],
        attn: AttentionBackend,
    ) -> RotaryStore | None:  # fmt: skip
        """Where LoRA's q/k/v products of x's rows run beside the GEMM and the kernel that
        rotates q and k and writes K/V can add them (`attend_added`); else None."""
        return attn.rotary_store(self.layer_id, *cos_sin) if lora.runs_beside("qkv", x) else None

    def attend_added(
        self, store: RotaryStore, qkv: torch.Tensor, added: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """`attend` of the q/k/v rows plus `added` (LoRA's products), added by the kernel that
        rotates and writes K/V (`RotaryStore.write`): no launch of their own."""
        heads = added.view(qkv.shape[0], -1, self.head_dim)
        q = store.write(*self.heads(qkv), self.qk_norm(), heads)
        return attn.attend_rotated(self.layer_id, q).reshape(qkv.shape[0], -1)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]`: views of the q/k/v projection's rows."""
        q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))  # fmt: skip

    def attend(
        self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend
    ) -> torch.Tensor:
        """The attention output `[T, heads * head_dim]` for the q/k/v projection's rows."""
        q, k, v = self.heads(qkv)
        cos, sin = cos_sin
        qk_norm = self.qk_norm()
        # A backend that writes K/V itself may norm (Qwen3) and rotate q and k in that same
        # kernel (FlashInfer on CUDA: `forward_rotary`); the others are given them rotated.
        forward_rotary = getattr(attn, "forward_rotary", None)
        if forward_rotary is not None:
            out = forward_rotary(self.layer_id, q, k, v, cos, sin, qk_norm=qk_norm)
        else:
            if qk_norm is not None:
                q, k = qk_norm.apply(q, k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = attn.forward(self.layer_id, q, k, v)
        return out.reshape(qkv.shape[0], -1)

    def qk_norm(self) -> QKNorm | None:
        """The q/k norms (Qwen3) for the attention backend; None for models without."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
