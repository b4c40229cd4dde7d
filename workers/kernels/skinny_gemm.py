"""Skinny GEMM (Triton): y = x W^T for a few 16-bit rows of x, at the weight-read bandwidth.

A decode step multiplies 1-64 rows by every weight of the model once, so its GEMMs are bound by
reading W, not by arithmetic. On its own the kernel beats cuBLAS on some of Llama-3-8B's shapes
only (4-8% on the LM head at every M <= 64, 7-17% on q/k/v and o_proj at M = 1, 3-5% on o_proj
at M = 4-32; an H200, bench/bench_gemm_decode.py). Inside a decode step it also launches with
programmatic dependent launch (`workers/kernels/pdl.py`): it loads its first K tile of W before
waiting for x, so the weight stream starts while the previous kernel ends; there it beat cuBLAS
on every measured shape (see WINS). Two kernels, one accumulation rule (fp32, one rounding to
x's dtype at the end, bias added in fp32 before it):
- `_gemv_kernel` (M <= 8): each program streams BLOCK_N rows of W with wide loads and
  multiplies them elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced once at the
  end, so the loop holds no shuffles; a small BLOCK_N gives enough programs to keep every
  multiprocessor's loads in flight. GATED computes silu(gate) * up of a [gate; up] weight
  (an MLP's gate_up projection) in the same pass, so no activation kernel follows.
- `_dot_kernel` (M > 1): tensor-core tiles, W pipelined through shared memory (num_stages deep);
  SWAP puts N on the MMA's M side (y^T = W x^T), which lets wide N tiles use the larger MMA.

`CONFIGS` holds the launch config per (N, K, M bucket) measured for Llama-3-8B; `applies` says
where the kernel is used, and callers (`workers/model/layers.py`) use F.linear everywhere else,
unmeasured shapes included. Split-K configs (several programs per output tile, each over a K
range) give the shapes with few output tiles (N = 4096) enough programs; the last program of a
tile adds the partials. Nothing here tunes at run time, syncs the host or allocates beyond the
output (the split-K buffers are allocated once, on the first split-K call), so calls can be
captured in CUDA graphs once each config has compiled, which the engine's warm-up forwards do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs

SUMSQ_SLOTS = 8  # float64 sums of squares per row (`_finish`): 1/8 of the adds contend on each
_SLOTS = tl.constexpr(SUMSQ_SLOTS)


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # tensor-core kernel (else the GEMV kernel, for M <= MAX_GEMV_ROWS)
    swap: bool = False  # dot kernel computes y^T = W x^T
    split_k: int = 1  # programs per output tile, each over a K range (see _epilogue)
    maxnreg: int | None = None  # registers a thread at most (ptxas's own choice when None)


@triton.jit
def _finish(
    acc, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
    HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
):  # fmt: skip
    """Store y = acc (+ bias) (+ res) in y's dtype. SUMSQ_OUT: also add the squares of each
    stored row's values to one of its SUMSQ_SLOTS float64 sums (this program's, by tile): the next
    RMSNorm's variance, so no norm kernel reads y again. The adds land in any order, but in
    float64 the squares of 16-bit values sum exactly unless a row's values span more than
    ~2^18, and even then the order moves only the float64's last bit, not the float32 rms
    (bar a tie one time in ~2^29)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ADD_RESIDUAL:
        acc += res
    y_ptrs = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=mask)
    if SUMSQ_OUT:
        y64 = tl.where(mask, y.to(tl.float64), 0.0)
        slot = ss_ptr + offs_m * _SLOTS + tl.program_id(0) % _SLOTS
        tl.atomic_add(slot, tl.sum(y64 * y64, axis=1), mask=offs_m < M, sem="relaxed")


@triton.jit
def _residual(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of the residual that `_finish` adds (fp32), or 0."""
    if ADD_RESIDUAL:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ptrs = r_ptr + offs_m[:, None] * stride_r + offs_n[None, :]
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        return 0.0


@triton.jit
def _input_scale(ss_ptr, offs_m, M, K, eps, NORM_IN: tl.constexpr):
    """NORM_IN: 1 / rms of each row of x, from the SUMSQ_SLOTS float64 sums of its squares that the
    kernel which wrote x added (`_finish`); x is then the input of an RMSNorm whose gain was
    folded into W's columns, and the product scaled by this equals W times the normed x."""
    if NORM_IN:
        slots = tl.arange(0, _SLOTS)[None, :]
        sums = tl.load(ss_ptr + offs_m[:, None] * _SLOTS + slots, mask=(offs_m < M)[:, None])
        return tl.rsqrt((tl.sum(sums, axis=1) / K).to(tl.float32) + eps)
    else:
        return tl.full(offs_m.shape, 1.0, tl.float32)


@triton.jit
def _epilogue(
    acc, res, y_ptr, b_ptr, ss_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_y,
    HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Store the [BLOCK_M, BLOCK_N] fp32 tile. With SPLIT_K > 1 each of the tile's programs
    writes its partial sum to the workspace and counts itself in on the tile's lock; the last
    one to arrive adds the partials (in split order, so results do not depend on arrival),
    writes y and resets the lock to 0 for the next launch."""
    if SPLIT_K == 1:
        _finish(acc, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
                HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT)  # fmt: skip
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + tl.program_id(2) * M * N, acc, mask=mask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(total, res, y_ptr, b_ptr, ss_ptr, offs_m, offs_n, M, N, stride_y,
                    HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT)  # fmt: skip
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _k_tile(ptrs, k0, K, offs_k, EVEN_K: tl.constexpr, WEIGHT: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of a row block of x or W (zeros past K). W is read once per
    step, so it goes first when L2 evicts, keeping x and the KV cache there."""
    if EVEN_K:
        if WEIGHT:  # noqa: SIM108 - constexpr branches
            tile = tl.load(ptrs, eviction_policy="evict_first")
        else:
            tile = tl.load(ptrs)
    else:
        mask = (k0 + offs_k < K)[None, :]
        if WEIGHT:  # noqa: SIM108 - constexpr branches
            tile = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _tile(
    x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """This program's rows of x and y (offs_m), rows of W (offs_n), first K column and pointers
    to its first K tile of x and W. A tail tile re-reads valid rows (modulo); its results are
    never stored."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = tl.program_id(2) * K_PER
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_w + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + (offs_m % M)[:, None] * stride_x + (k_start + offs_k)[None, :]
    return offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, r_ptr, ss_in_ptr, ss_out_ptr, M, N, K, K_PER,
    stride_x, stride_w, stride_y, stride_r, eps,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    LOOP_STAGES: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """GATED: W holds [gate; up] (2N rows) and y = silu(gate x) * (up x), rounded as
    `fused.silu_and_mul` rounds the unfused product (NORM_IN scales both before it)."""
    start_dependents(PDL)
    offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs = _tile(
        x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K
    )
    u_ptrs = w_ptrs + N * stride_w  # GATED: the up row of each gate row
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # The first K tile of W streams in before x, the previous kernel's output, is ready (PDL).
    w = _k_tile(w_ptrs, k_start, K, offs_k, EVEN_K, True)
    if GATED:
        up = _k_tile(u_ptrs, k_start, K, offs_k, EVEN_K, True)
    wait_for_inputs(PDL)
    x = _k_tile(x_ptrs, k_start, K, offs_k, EVEN_K, False).to(tl.float32)[:, None, :]
    # Issued now, their latency hides behind the weight stream.
    inv_rms = _input_scale(ss_in_ptr, offs_m, M, K, eps, NORM_IN)
    res = _residual(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL)
    acc += w.to(tl.float32)[None, :, :] * x
    if GATED:
        acc_up += up.to(tl.float32)[None, :, :] * x
    for k0 in tl.range(k_start + BLOCK_K, k_start + K_PER, BLOCK_K, num_stages=LOOP_STAGES):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = _k_tile(w_ptrs, k0, K, offs_k, EVEN_K, True)
        x = _k_tile(x_ptrs, k0, K, offs_k, EVEN_K, False).to(tl.float32)[:, None, :]
        acc += w.to(tl.float32)[None, :, :] * x
        if GATED:
            u_ptrs += BLOCK_K
            acc_up += _k_tile(u_ptrs, k0, K, offs_k, EVEN_K, True).to(tl.float32)[None, :, :] * x
    y = tl.sum(acc, axis=2) * inv_rms[:, None]
    if GATED:
        dtype = y_ptr.dtype.element_ty
        gate = y.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        y = act * (tl.sum(acc_up, axis=2) * inv_rms[:, None]).to(dtype).to(tl.float32)
    _epilogue(y, res, y_ptr, b_ptr, ss_out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_y,
              HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT, SPLIT_K)  # fmt: skip


@triton.jit
def _dot_step(acc, x, w, SWAP: tl.constexpr):
    if SWAP:  # noqa: SIM108 - a constexpr branch
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, r_ptr, ss_in_ptr, ss_out_ptr, M, N, K, K_PER,
    stride_x, stride_w, stride_y, stride_r, eps,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
    NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    offs_m, offs_n, offs_k, k_start, w_ptrs, x_ptrs = _tile(
        x_ptr, w_ptr, M, N, K_PER, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K
    )
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The first K tile of W streams in before x, the previous kernel's output, is ready (PDL).
    w = _k_tile(w_ptrs, k_start, K, offs_k, EVEN_K, True)
    wait_for_inputs(PDL)
    inv_rms = _input_scale(ss_in_ptr, offs_m, M, K, eps, NORM_IN)
    acc = _dot_step(acc, _k_tile(x_ptrs, k_start, K, offs_k, EVEN_K, False), w, SWAP)
    for k0 in range(k_start + BLOCK_K, k_start + K_PER, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = _k_tile(w_ptrs, k0, K, offs_k, EVEN_K, True)
        acc = _dot_step(acc, _k_tile(x_ptrs, k0, K, offs_k, EVEN_K, False), w, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    res = _residual(r_ptr, offs_m, offs_n, M, N, stride_r, ADD_RESIDUAL)
    _epilogue(acc * inv_rms[:, None], res, y_ptr, b_ptr, ss_out_ptr, ws_ptr, lock_ptr, offs_m,
              offs_n, M, N, stride_y, HAS_BIAS, ADD_RESIDUAL, SUMSQ_OUT, SPLIT_K)  # fmt: skip


def _bucket(m: int) -> int:
    return triton.next_power_of_2(m)


# Per (N, K, M bucket: M rounded up to a power of two): the fastest launch config that
# `python -m bench.bench_gemm_decode --sweep` found on an H200 for Llama-3-8B's q/k/v, o_proj,
# gate_up, down and LM head (bf16; one rank). At M = 1 the GEMV configs were then re-chosen
# inside whole decode steps (each candidate's batch-1 graph re-captured and replayed, README):
# there the configs that stage W through shared memory (num_stages > 1: `tl.range` pipelines
# the loop's loads with cp.async) won for gate_up, o_proj, down and the LM head, by up to
# 0.08 ms a step each, though not for q/k/v.
_GEMV4 = Config(4, 512)
_GEMV4_PIPELINED = Config(4, 1024, 4, 2)  # W through shared memory, a K tile ahead
# 80 registers keep its 768 programs at q/k/v's shape in one wave (6 a multiprocessor); reading
# x's sums of squares (NORM_IN) would take ptxas to 88, which it fits in 80 without spilling.
_GEMV8 = Config(8, 512, maxnreg=80)
_SWAP64 = Config(64, 128, 4, 4, dot=True, swap=True)
_SWAP128 = Config(128, 128, 4, 3, dot=True, swap=True)
CONFIGS: dict[tuple[int, int, int], Config] = {
    (6144, 4096, 1): _GEMV8,
    **{(6144, 4096, m): _SWAP64 for m in (2, 4, 8, 16, 32, 64)},
    (4096, 4096, 1): _GEMV4_PIPELINED,
    **{(4096, 4096, m): replace(_SWAP64, split_k=4 if m == 2 else 2) for m in (2, 4, 8, 16, 32)},
    (4096, 4096, 64): Config(32, 128, 4, 4, dot=True),
    # gated (silu(gate) * up): 2 rows of each, one warp, W through shared memory 3 tiles deep
    (28672, 4096, 1): Config(2, 512, 1, 3),
    **{(28672, 4096, m): _SWAP128 for m in (2, 4, 8, 16)},
    (28672, 4096, 32): _SWAP64,
    (28672, 4096, 64): replace(_SWAP128, num_warps=8),
    (4096, 14336, 1): _GEMV4_PIPELINED,
    **{(4096, 14336, m): replace(_SWAP64, split_k=4) for m in (2, 4, 8)},
    **{(4096, 14336, m): replace(_SWAP64, split_k=2) for m in (16, 32, 64)},
    (128256, 4096, 1): Config(8, 1024, 4, 2),
    **{(128256, 4096, m): _SWAP128 for m in (2, 4, 64)},
    **{(128256, 4096, m): _SWAP64 for m in (8, 16, 32)},
    # One rank's shards at tensor_parallel_size=2, batch 1 (q/k/v, gate_up and the LM head split
    # N, o_proj and down K). Not swept: each takes its unsharded shape's kernel with at least as
    # many programs; with them a whole TP=2 step beat cuBLAS's (README, tensor-parallel decode),
    # and the gated gate_up shard's one-warp config took it from 3.41 to 3.20 ms (A/B, 2 runs).
    (3072, 4096, 1): _GEMV4,
    (4096, 2048, 1): _GEMV4,
    (14336, 4096, 1): Config(2, 512, 1),  # gated, as the unsharded gate_up
    (4096, 7168, 1): _GEMV4,
    (64128, 4096, 1): replace(_SWAP128, num_warps=8),
}
# Where the kernel is used. With programmatic dependent launch (Hopper on; `pdl.py`) every
# CONFIGS cell: each kernel then streams its first weights while the one before it ends, and
# whole decode steps ran faster with it than with cuBLAS at every batch size measured (1-64, a
# Llama-3-8B step on an H200: graph replay 1-4% shorter). Without PDL only the cells where it beat
# F.linear by >= 2% on its own, in the sweep and in a second H200 run (WINS). Shapes not in
# CONFIGS were not measured and always use F.linear.
WINS: set[tuple[int, int, int]] = {
    (6144, 4096, 1),
    *[(4096, 4096, m) for m in (1, 4, 8, 16, 32)],
    (4096, 14336, 64),
    *[(128256, 4096, m) for m in (1, 2, 4, 8, 16, 32, 64)],
}
MAX_GEMV_ROWS = 8  # its fp32 accumulator holds BLOCK_M x BLOCK_N x BLOCK_K


def default_config(m: int, n: int, k: int) -> Config:
    block_k = max(16, min(512, triton.next_power_of_2(k)))
    if m == 1:
        return Config(block_n=8, block_k=block_k, num_warps=4)
    return Config(64, min(block_k, 128), 4, 4, dot=True, swap=True)


def config_for(m: int, n: int, k: int) -> Config:
    return CONFIGS.get((n, k, _bucket(m))) or default_config(m, n, k)


def applies(m: int, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `skinny_linear` beats F.linear for `m` rows times this [N, K] weight (`gated`:
    beats F.linear and `fused.silu_and_mul` for a [gate; up] weight, where the GEMV kernel does
    both)."""
    n, k = weight.shape
    key = (n, k, _bucket(m))
    if weight.stride(1) != 1 or not 0 < m <= 64 or key not in CONFIGS:
        return False
    if gated and (CONFIGS[key].dot or CONFIGS[key].split_k > 1):
        return False
    return key in WINS or pdl.enabled(weight.device)


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
) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight, bias)` for 2-D 16-bit `x` [M, K] and a row-major `weight` [N, K],
    in `out_dtype` (default x's; the product accumulates in float32 either way).
    `gated`: `weight` is [gate; up] ([2N, K], no bias) and the result `silu(gate) * up` [M, N],
    with the GEMV kernel only (M <= MAX_GEMV_ROWS, no split-K).
    A batch-1 decoder layer without norm kernels (`LlamaForCausalLM.fold_norm_gains`):
    `sumsq_in` [M, SUMSQ_SLOTS] float64 holds partial sums of the squares of x's rows (the
    `sumsq_out` of the launch that wrote x): x is RMS-normalised with `eps` on the way in, its
    gain already in W's columns. `residual` [M, N]: y = residual + x W^T. `sumsq_out` (zeroed by
    the caller): the squares of y's rows are added into it, for the next launch's `sumsq_in`."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or config_for(m, weight.shape[0], k)
    if gated and (cfg.dot or cfg.split_k > 1 or bias is not None or out_dtype is not None):
        raise ValueError(
            "the gated product runs on the GEMV kernel, in x's dtype, without split-K or bias"
        )
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
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
    kernel = _dot_kernel if cfg.dot else _gemv_kernel
    extra = dict(SWAP=cfg.swap) if cfg.dot else dict(GATED=gated, LOOP_STAGES=cfg.num_stages)
    r = residual if residual is not None else y  # unused pointers where off
    kernel[grid](
        x, weight, b, y, ws, locks, r, y if sumsq_in is None else sumsq_in,
        y if sumsq_out is None else sumsq_out, m, n, k, k_per, x.stride(0), weight.stride(0),
        y.stride(0), r.stride(0), eps,
        HAS_BIAS=bias is not None, EVEN_K=k % (cfg.split_k * cfg.block_k) == 0,
        SPLIT_K=cfg.split_k, NORM_IN=sumsq_in is not None, ADD_RESIDUAL=residual is not None,
        SUMSQ_OUT=sumsq_out is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **pdl.launch_options(x),
    )  # fmt: skip
    return y
