"""Tensor-parallel building blocks: column/row-parallel linears, vocab-parallel embedding.

Each parameter carries a `weight_loader(param, full_weight, shard_id)` that copies this rank's
slice of a full (unsharded) checkpoint tensor into it, so weights load straight into the shard
layout and no rank ever holds another rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.norms import HALF_DTYPES, rms_norm
from workers.kernels.weight_blocks import blocked_linear, rows_per_block
from workers.parallel.group import SINGLE, TPGroup

if TYPE_CHECKING:
    from workers.kernels.lora_sgmv import ShrunkRows
    from workers.kernels.rope import RotaryStore

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | str | None"], None]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear`, except for a few 16-bit rows on CUDA (decode batches), where the Triton skinny
    GEMM reads the weight faster than cuBLAS; `skinny_gemm.applies` says where it was measured
    to win. `out_dtype=torch.float32` keeps 16-bit products in float32 (they accumulate there):
    the logits, where bf16's rounding (0.125 apart at 16-32) would tie close tokens."""
    blocked = rows_per_block(weight) > 1
    if x.is_cuda and x.dtype in HALF_DTYPES and x.dim() == 2:
        from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

        if skinny_gemm.applies(x.shape[0], weight):
            return skinny_gemm.skinny_linear(x, weight, bias, out_dtype=out_dtype)
        if out_dtype == torch.float32 and bias is None and not blocked:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
    y = (blocked_linear if blocked else F.linear)(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu(x G^T) * (x U^T)` for `weight` = [G; U] (a gate_up projection, no bias). On CUDA in
    16 bits the skinny GEMM does the product and the activation in one launch where it runs
    without split-K, and `fused.silu_and_mul` follows the GEMM elsewhere."""
    if x.is_cuda and x.dtype in HALF_DTYPES and x.dim() == 2:
        from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

        if skinny_gemm.applies(x.shape[0], weight, gated=True):
            return skinny_gemm.skinny_linear(x, weight, gated=True)
    return silu_and_mul(linear(x, weight))


def silu_and_mul(y: torch.Tensor, added: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up` of `y` = [gate | up] `[T, 2n]`, or of `y + added` (LoRA's products
    made beside the GEMM that wrote y): one Triton launch on CUDA in 16 bits."""
    if y.is_cuda and y.dtype in HALF_DTYPES and y.dim() == 2:
        from workers.kernels import fused  # Triton: imported on first CUDA use

        return fused.silu_and_mul(y, added)
    gate, up = (y if added is None else y + added).chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: RMSNorm,
    sumsq: torch.Tensor | None, gated: bool = False, lora: ShrunkRows | None = None,
) -> torch.Tensor:  # fmt: skip
    """`linear(norm(x), weight, bias)` (`gated`: its `silu_and_mul_linear`) for a `norm` whose
    gain is folded into `weight`'s columns (`LlamaForCausalLM.fold_norm_gains`). With `sumsq`,
    the float64 sums of the squares of x's rows that the launch writing x left
    (`residual_linear`), the skinny GEMM scales its products by 1/rms and no norm kernel runs;
    without, `norm` runs first. `lora`: x's rows shrunk by their adapters, whose products the
    skinny GEMM adds (`skinny_gemm.lora_fits`; with `sumsq`)."""
    if sumsq is None:
        if lora is not None:
            raise ValueError("LoRA products in the GEMM need x's sums of squares (sumsq)")
        h = norm(x)
        return silu_and_mul_linear(h, weight) if gated else linear(h, weight, bias)
    from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

    in_one = gated and skinny_gemm.applies(x.shape[0], weight, gated=True)
    y = skinny_gemm.skinny_linear(x, weight, bias, gated=in_one, sumsq_in=sumsq, eps=norm.eps,
                                  lora=lora)  # fmt: skip
    return silu_and_mul(y) if gated and not in_one else y


def rms_linear_rotary(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: RMSNorm,
    sumsq: torch.Tensor | None, store: RotaryStore | None, lora: ShrunkRows | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """`rms_linear` of a q/k/v weight whose GEMM epilogue also rotates q and k and writes k and
    v where `store` says (`skinny_gemm.skinny_linear(rotary=...)`): the rotated q
    `[M, Hq * head_dim]`. None where the skinny GEMM does not take it that way."""
    if sumsq is None or store is None or x.dtype != store.cos.dtype:
        return None
    from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

    if not skinny_gemm.rotary_applies(x.shape[0], weight, store.head_dim):
        return None
    return skinny_gemm.skinny_linear(x, weight, bias, sumsq_in=sumsq, eps=norm.eps, rotary=store,
                                     lora=lora)  # fmt: skip


def residual_linear(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, sumsq: torch.Tensor | None,
    lora: ShrunkRows | None = None,
) -> torch.Tensor:  # fmt: skip
    """`residual + x W^T` (one rank: no all-reduce), in the skinny GEMM's epilogue where it runs
    x's rows; with `sumsq` (zeroed, CUDA), it also adds the squares of the sum's rows into it for
    `rms_linear`; with `lora` (see `rms_linear`), the adapters' products too."""
    if sumsq is None and lora is None and not skinny_takes_all(x, [weight]):
        return residual + linear(x, weight)
    from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

    return skinny_gemm.skinny_linear(x, weight, residual=residual, sumsq_out=sumsq, lora=lora)


def skinny_takes_all(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether the skinny GEMM runs x's rows times each of these weights (CUDA, 16 bits)."""
    if not (x.is_cuda and x.dtype in HALF_DTYPES and x.dim() == 2):
        return False
    from workers.kernels import skinny_gemm  # Triton: imported on first CUDA use

    return all(skinny_gemm.applies(x.shape[0], w) for w in weights)


def _param(shape: tuple[int, ...], loader: WeightLoader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(param: nn.Parameter, weight: torch.Tensor) -> None:
    if param.shape != weight.shape:
        raise ValueError(
            f"checkpoint shape {tuple(weight.shape)} != parameter {tuple(param.shape)}"
        )
    param.data.copy_(weight)


def replicated_loader(param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
    _copy(param, weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), replicated_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup = SINGLE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)`: the residual add folded into the norm's kernel
        on CUDA in 16 bits; elsewhere the add then `forward`, bit for bit as written out.
        With `tp`, x is this rank's partial sum of a row-parallel output (`reduce=False`), summed
        over the group first: in the same kernel where the IPC all-reduce takes it."""
        if tp.size > 1:
            if tp.ipc is not None and tp.ipc.takes_rows(x, residual):
                return tp.ipc.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            x = tp.all_reduce(x)
        if x.is_cuda and x.dtype in HALF_DTYPES and x.dim() == 2:
            from workers.kernels import fused  # Triton: imported on first CUDA use

            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank produces its slice of y.

    `output_sizes` lists the logical sub-matrices stacked in W (e.g. gate and up); each is split
    across ranks on its own, so rank r holds [gate_r; up_r].
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.shard_sizes = [tp.shard(n, "output features") for n in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = _param((out, in_features), self._load)
        self.bias = _param((out,), self._load) if bias else None

    def _offset(self, shard_id: int) -> int:
        return sum(self.shard_sizes[:shard_id])

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
        idx = 0 if shard_id is None else int(shard_id)  # type: ignore[call-overload]
        size = self.shard_sizes[idx]
        part = weight.narrow(0, self.tp.rank * size, size)
        _copy_into(param.data.narrow(0, self._offset(idx), size), part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint shard {tuple(src.shape)} != parameter slice {tuple(dst.shape)}"
        )
    dst.copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split across ranks, or replicated when there are
    fewer KV heads than ranks (each rank then holds the one KV head its query heads use)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        if tp.size > num_kv_heads and tp.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp.size} must divide or be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.head_dim = head_dim
        nn.Module.__init__(self)
        self.tp = tp
        self.shard_sizes = [self.num_heads * head_dim] + [self.num_kv_heads * head_dim] * 2
        self.weight = _param((sum(self.shard_sizes), hidden), self._load)
        self.bias = _param((sum(self.shard_sizes),), self._load) if bias else None

    @property
    def kv_head_offset(self) -> int:
        """First global KV head this rank holds."""
        return (self.tp.rank // self.kv_replicas) * self.num_kv_heads

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
        idx = {"q": 0, "k": 1, "v": 2}[str(shard_id)]
        size = self.shard_sizes[idx]
        start = self.tp.rank * size if idx == 0 else self.kv_head_offset * self.head_dim
        _copy_into(param.data.narrow(0, self._offset(idx), size), weight.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_shard = tp.shard(in_features, "input features")
        self.weight = _param((out_features, self.in_shard), self._load)
        self.bias = _param((out_features,), replicated_loader) if bias else None

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
        _copy(param, weight.narrow(1, self.tp.rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: this rank's partial sum, for a consumer that sums it over the group
        itself (`RMSNorm.add_forward`); only without bias, which goes after the sum."""
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel linear with bias cannot defer its all-reduce")
            return linear(x, self.weight)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; ranks zero what they don't own, then all-reduce.
    The vocabulary is padded up to a multiple of the TP size."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.weight = _param((self.shard, dim), self._load)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: object = None) -> None:
        part = weight[self.start : self.start + self.shard]
        param.data.zero_()
        _copy_into(param.data[: part.shape[0]], part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary: each rank computes its vocab slice, then all-gather."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda or hidden.dim() != 2:
            local = linear(hidden, self.weight, out_dtype=torch.float32)
        else:
            # On the CPU, W h^T then a transposed copy: against a vocabulary-sized weight the
            # float32 GEMM takes h W^T 1.3-3.7x slower for 3-64 rows (SmolLM2's [49152, 576]
            # on 2 cores: 53 ms against 14 ms for 3 rows; bench/cpu_lm_head.py).
            local = torch.mm(self.weight, hidden.t()).t().contiguous().float()
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]
