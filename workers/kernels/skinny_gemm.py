"""Skinny GEMM (Triton): y = x W^T for a few 16-bit rows of x, at the weight-read bandwidth.

A decode step multiplies 1-64 rows by every weight of the model once, so its GEMMs are bound by
reading W, not by arithmetic. Two kernels share one accumulation rule and epilogue
(`skinny_tiles`): the GEMV kernel for M <= MAX_GEMV_ROWS (`skinny_gemv`) and the tensor-core
kernel (`skinny_dot`). Both launch with programmatic dependent launch (`pdl.py`): they load their
first K tile of W before waiting for x, so the weight stream starts while the previous kernel
ends.

This module picks the launch config per (N, K, M bucket) from the GPU model's table
(`tuning.py`); `applies` says where the kernel is used, and callers (`workers/model/layers.py`)
use F.linear everywhere else, unmeasured shapes and GPUs without a table included. Split-K
configs (several programs per output tile, each over a K range) give the shapes with few output
tiles enough programs; the last program of a tile adds the partials. Nothing here tunes at run
time, syncs the host or allocates beyond the output (the split-K buffers are allocated once, on
the first split-K call), so calls can be captured in CUDA graphs once each config has compiled,
which the engine's warm-up forwards do.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from workers.kernels import pdl
from workers.kernels.lora_sgmv import MAX_TOKENS, ShrunkRows, part_ends
from workers.kernels.rope import RotaryStore, kv_max
from workers.kernels.skinny_dot import dot_kernel
from workers.kernels.skinny_gemv import gemv_kernel
from workers.kernels.skinny_tiles import SUMSQ_SLOTS
from workers.kernels.tuning import Config, SkinnyGemmTable, skinny_gemm_table
from workers.kernels.weight_blocks import rows_per_block


def _bucket(m: int) -> int:
    return triton.next_power_of_2(m)


MAX_GEMV_ROWS = 8  # its fp32 accumulator holds BLOCK_M x BLOCK_N x BLOCK_K
# One row over a weight in blocks of rows (`weight_blocks`): the GEMV kernel, each program a
# run of 64 of a block's rows by 32 of K a step (the table's GEMV cells read rows)
BLOCKED_GEMV = Config(block_n=64, block_k=32, num_warps=2, num_stages=3)


def default_config(m: int, n: int, k: int) -> Config:
    block_k = max(16, min(512, triton.next_power_of_2(k)))
    if m == 1:
        return Config(block_n=8, block_k=block_k, num_warps=4)
    return Config(64, min(block_k, 128), 4, 4, dot=True, swap=True)


@functools.cache
def _table(device_index: int) -> SkinnyGemmTable:
    return skinny_gemm_table(torch.cuda.get_device_name(device_index))


def table(device: torch.device) -> SkinnyGemmTable:
    """The launch table of `device`'s GPU model (`tuning.py`), read once."""
    return _table(device.index if device.index is not None else torch.cuda.current_device())


def config_for(m: int, n: int, k: int, device: torch.device) -> Config:
    return table(device).configs.get((n, k, _bucket(m))) or default_config(m, n, k)


def applies(m: int, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `skinny_linear` beats F.linear for `m` rows times this [N, K] weight (`gated`:
    beats F.linear and `fused.silu_and_mul` for a [gate; up] weight, in one launch where its
    config has no split-K)."""
    n, k = weight.shape
    key = (n, k, _bucket(m))
    if weight.stride(1) != 1 or not 0 < m <= 64:
        return False
    cells = table(weight.device)
    cfg = cells.configs.get(key)
    if cfg is None or (gated and cfg.split_k > 1):
        return False
    # With dependent launch every measured cell: the kernel then streams its first weights
    # while the one before it ends, which made whole decode steps faster than cuBLAS's
    # (docs/notes/skinny-gemm-tuning.md). Without it only the cells it won on its own.
    return key in cells.wins or pdl.enabled(weight.device)


def rotary_applies(m: int, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether `skinny_linear(rotary=...)` takes `m` rows times this q/k/v weight: the
    tensor-core kernel without split-K, its tiles within a head."""
    if not applies(m, weight):
        return False
    return _rotary_fits(config_for(m, weight.shape[0], weight.shape[1], weight.device), head_dim)


def _rotary_fits(cfg: Config, head_dim: int) -> bool:
    """The rotary epilogue's needs of a config: the tensor-core kernel, no split-K (one program
    holds the finished tile), tiles of whole rotated pairs within one head."""
    return cfg.dot and cfg.split_k == 1 and cfg.block_n >= 2 and head_dim % cfg.block_n == 0


WORKSPACE_FLOATS = 8 * 2**20  # split-K partials: split_k * M * N fp32 values at most
LOCKS = 2**16  # split-K tile counters: output tiles per launch at most
_split_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K workspace and zeroed tile locks: allocated once at a fixed size, on
    the first split-K call (a warm-up, before any CUDA-graph capture), and never reallocated,
    so captured graphs keep valid pointers. Launches share them, so they must run in order on
    one stream (as a model's forward does)."""
    if device not in _split_buffers:
        ws = torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device)
        _split_buffers[device] = ws, torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _split_buffers[device]


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: Config | None = None, gated: bool = False, out_dtype: torch.dtype | None = None,
    sumsq_in: torch.Tensor | None = None, eps: float = 0.0,
    residual: torch.Tensor | None = None, sumsq_out: torch.Tensor | None = None,
    rotary: RotaryStore | None = None, lora: ShrunkRows | None = None,
) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight, bias)` for 2-D 16-bit `x` [M, K] and a `weight` [N, K], row-major or
    in blocks of rows (`weight_blocks`: the tensor-core kernel then runs at every M), in
    `out_dtype` (default x's; the product accumulates in float32 either way).
    `gated`: `weight` is [gate; up] ([2N, K], no bias) and the result `silu(gate) * up` [M, N],
    without split-K; the tensor-core kernel then takes half the config's block_n a tile of
    each, so a program reads as many weight bytes as the ungated product's.
    A batch-1 decoder layer without norm kernels (`LlamaForCausalLM.fold_norm_gains`):
    `sumsq_in` [M, SUMSQ_SLOTS] float64 holds partial sums of the squares of x's rows (the
    `sumsq_out` of the launch that wrote x): x is RMS-normalised with `eps` on the way in, its
    gain already in W's columns. `residual` [M, N]: y = residual + x W^T. `sumsq_out` (zeroed by
    the caller): the squares of y's rows are added into it, for the next launch's `sumsq_in`.
    `rotary`: `weight` is a q/k/v projection ([Hq + 2 Hkv] heads of `rotary.head_dim` rows) and
    the tensor-core kernel's epilogue does `rope.rotary_store` (`rotary_applies`): k and v go
    into the KV pool and the result is the rotated q [M, Hq * head_dim], in x's dtype.
    `lora`: x's rows shrunk by their adapters' A (`lora_sgmv.shrunk_rows`), whose products with
    B the tensor-core kernel adds to each tile before its other epilogues (`lora_fits`)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = launch_config(m, weight, gated, config)
    w_block = rows_per_block(weight)  # a block's stride is its K x block values
    if gated and (cfg.split_k > 1 or bias is not None or out_dtype is not None):
        raise ValueError("the gated product runs in x's dtype, without split-K or bias")
    if lora is not None and not (cfg.dot and _parts_fit(cfg, lora.ends, n)):
        raise ValueError(f"the LoRA epilogue needs the tensor-core kernel, tiles within its "
                         f"parts {lora.ends}; got {cfg}")  # fmt: skip
    if w_block > 1 and (n % cfg.block_n or max(w_block, cfg.block_n) % min(w_block, cfg.block_n)):
        raise ValueError(f"tiles of {cfg.block_n} rows do not cover blocks of {w_block} of {n}")
    others = gated or out_dtype is not None or residual is not None or sumsq_out is not None
    rot_args, rot_half, rot_kv_max = _rotary_args(rotary, cfg, x, n, others)
    out_n = n if rotary is None else rotary.num_q_heads * rotary.head_dim
    y = torch.empty((m, out_n), dtype=out_dtype or x.dtype, device=x.device)
    for name, sums in (("sumsq_in", sumsq_in), ("sumsq_out", sumsq_out)):
        if sums is not None and (sums.shape != (m, SUMSQ_SLOTS) or sums.dtype != torch.float64):
            raise ValueError(f"{name} must be float64 [{m}, {SUMSQ_SLOTS}], not {sums.shape}")
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be a row-major [{m}, {n}], not {residual.shape}")
    b = bias if bias is not None else y  # an unused pointer when HAS_BIAS is off
    block_m = _bucket(m) if not cfg.dot else max(16, min(64, _bucket(m)))
    if not cfg.dot and m > MAX_GEMV_ROWS:
        raise ValueError(f"the GEMV kernel takes at most {MAX_GEMV_ROWS} rows, not {m}")
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), cfg.split_k)
    k_per = triton.cdiv(k, cfg.split_k * cfg.block_k) * cfg.block_k  # whole K tiles per split
    ws, locks = y, y  # unused pointers without split-K
    if cfg.split_k > 1:
        ws, locks = _buffers(x.device)
        if cfg.split_k * m * n > ws.numel() or grid[0] * grid[1] > locks.numel():
            raise ValueError(f"split-K {cfg.split_k} of a {m}x{n} output exceeds its buffers")
    kernel = dot_kernel if cfg.dot else gemv_kernel
    extra: dict[str, object] = dict(LOOP_STAGES=cfg.num_stages)
    if cfg.dot:
        extra = dict(SWAP=cfg.swap, ROTARY_HALF=rot_half, KV_MAX=rot_kv_max)
        lora_args, lora_consts = _lora_args(lora, y)
        extra |= lora_consts
        rot_args += lora_args
    r = residual if residual is not None else y  # unused pointers where off
    kernel[grid](
        x, weight, b, y, ws, locks, r, y if sumsq_in is None else sumsq_in,
        y if sumsq_out is None else sumsq_out, m, n, k, k_per, x.stride(0),
        weight.stride(0) * w_block, y.stride(0), r.stride(0), eps, *(rot_args if cfg.dot else ()),
        GATED=gated, HAS_BIAS=bias is not None, EVEN_K=k % (cfg.split_k * cfg.block_k) == 0,
        SPLIT_K=cfg.split_k, NORM_IN=sumsq_in is not None, ADD_RESIDUAL=residual is not None,
        SUMSQ_OUT=sumsq_out is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, W_BLOCK=w_block, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **extra,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **pdl.launch_options(x),
    )  # fmt: skip
    return y


def launch_config(
    m: int, weight: torch.Tensor, gated: bool = False, config: Config | None = None
) -> Config:
    """`skinny_linear`'s config for `m` rows times `weight` (`config`, else the table's): where
    W is blocked and the table's cell is a GEMV's (whose tiles are a few rows), `BLOCKED_GEMV`
    at one row and the tensor-core kernel above; the gated product's tensor-core tiles half as
    wide, a tile of each of gate and up."""
    n, k = weight.shape
    cfg = config or config_for(m, n, k, weight.device)
    if rows_per_block(weight) > 1 and not cfg.dot and config is None:
        cfg = BLOCKED_GEMV if m == 1 else config_for(2, n, k, weight.device)
    if gated and cfg.dot:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    return cfg


def lora_fits(m: int, weight: torch.Tensor, out_parts: list[int], gated: bool = False) -> bool:
    """Whether `skinny_linear(lora=...)` takes `m` rows times `weight` with LoRA parts of
    `out_parts` columns: the skinny GEMM runs it on its tensor-core kernel (where the GEMV
    kernel is the faster, at 1-8 rows, the products run after it instead), and no tile
    straddles two parts."""
    if not applies(m, weight, gated) or m > MAX_TOKENS:
        return False
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    cfg = launch_config(m, weight, gated)
    fused = cfg.dot and not (gated and cfg.split_k > 1)
    return fused and _parts_fit(cfg, part_ends(out_parts), n)


def _parts_fit(cfg: Config, ends: tuple[int, int], n: int) -> bool:
    return all(end >= n or end % cfg.block_n == 0 for end in ends)


def _lora_args(lora: ShrunkRows | None, y: torch.Tensor) -> tuple[tuple, dict[str, int]]:
    """The dot kernel's LoRA arguments and constexprs; placeholders (LORA_PARTS 0) without."""
    if lora is None:
        consts = dict(LORA_SLOTS=1, LORA_R=1, LORA_R_PAD=16, LORA_PARTS=0)
        return (y, y, y, 0, 0, 0, 0), consts
    slots, rank = lora.b.shape[1:]
    splits, tokens, stacked = lora.partial.shape
    if lora.mask.shape != (tokens, slots) or not lora.mask.is_contiguous():
        raise ValueError(f"the LoRA mask must be a contiguous [{tokens}, {slots}]")
    if not lora.b.is_contiguous() or tokens != y.shape[0]:
        raise ValueError("B must be contiguous and the shrunk rows those of x")
    args = (lora.partial, lora.mask, lora.b, lora.b.shape[0], splits, *lora.ends)
    consts = dict(LORA_SLOTS=slots, LORA_R=rank, LORA_R_PAD=max(16, triton.next_power_of_2(rank)),
                  LORA_PARTS=stacked // rank)  # fmt: skip
    return args, consts


def _rotary_args(
    store: RotaryStore | None, cfg: Config, x: torch.Tensor, n: int, other_epilogue: bool
) -> tuple[tuple, int, float]:
    """The dot kernel's rotary arguments (`rope.store_rotated`), its ROTARY_HALF and KV_MAX;
    unused placeholders (ROTARY_HALF 0) without `store`."""
    if store is None:
        return (x, x, x, x, x) + (0,) * 7 + (1.0, 1.0), 0, 0.0
    dim, kv = store.head_dim, store.kv
    if not _rotary_fits(cfg, dim) or other_epilogue:
        raise ValueError(
            f"the rotary epilogue needs the tensor-core kernel, no split-K, tiles within a head "
            f"of {dim} and no other epilogue; got {cfg} for a {dim}-wide head"
        )
    if n != (store.num_q_heads + 2 * store.num_kv_heads) * dim or kv.stride(-1) != 1:
        raise ValueError(f"a q/k/v weight of {n} rows does not match {store}")
    if store.cos.stride(-1) != 1 or store.cos.stride() != store.sin.stride():
        raise ValueError("cos and sin must share their strides, the last one 1")
    args = (
        store.cos, store.sin, kv, store.slot_pages, store.slot_offsets, store.cos.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), store.num_q_heads,
        store.num_kv_heads, 1.0 / store.k_scale, 1.0 / store.v_scale,
    )  # fmt: skip
    return args, dim // 2, kv_max(kv)
