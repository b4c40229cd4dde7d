"""Fused MoE (Triton): a layer's routed experts in two grouped GEMMs and one reduce.

1. `moe_align.align`: the (token, slot) pairs grouped by expert, each expert's run padded to a
   multiple of BLOCK_M, so that every M tile of pairs belongs to one expert (`tile_expert`; -1:
   a tile past the runs). Two launches, no host sync: the grid is sized by a bound and a tile
   without pairs returns at once. Pairs routed to another rank's experts get no slot, experts
   without pairs no tile, so a decode step reads only the experts its batch routes to.
2. `_w13_kernel`: each tile's token rows gathered from x times its expert's gate and up rows,
   SiLU(gate) * up in the epilogue -> act [padded pairs, I].
3. `_w2_kernel`: act times the expert's down matrix, scaled in the epilogue by the pair's routing
   weight and written to the pair's own row [pairs, H] (no atomics: the result is the same
   whatever order tiles run in).
4. The k rows of each token summed (one reduce).
Launch configs: `moe_tuning` (per GPU model, bench/sweep_moe.py); a config with `gemv` set (batch
1-8 by default) takes `moe_gemv.gemv_moe` instead: two launches, no alignment, the sum fused.
Every launch here, the routing's included, uses PDL (`pdl.py`): at batch 1 the layer is a chain
of short kernels. Nothing allocates beyond the step's buffers or syncs the host, so a decode
step's calls can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.moe_align import align
from workers.kernels.moe_gemv import gemv_moe
from workers.kernels.moe_tuning import MoEConfig, MoETable, moe_config, moe_table
from workers.kernels.pdl import start_dependents, wait_for_inputs


@triton.jit
def _tile_and_column_block(N, BLOCK_N: tl.constexpr):
    """This program's (M tile, N block), the N blocks of a tile adjacent in launch order: the
    programs running at once share their tiles' gathered rows and their experts' weights in L2.
    With the tile varying fastest, each tile's rows were read again for every N block from HBM
    (at a prefill of 8,192 tokens, ~6-16x the rows a layer)."""
    blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    return pid // blocks, pid % blocks


@triton.jit
def _w13_kernel(
    x_ptr, w_ptr, act_ptr, pairs_ptr, tile_expert_ptr, num_pairs, top_k, H, INTER,
    stride_x, stride_we, stride_wn, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the tile's expert comes from the alignment just before
    tile, pn = _tile_and_column_block(INTER, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        gate = tl.dot(a, tl.load(g_ptrs, mask=w_ok, other=0.0), gate)
        up = tl.dot(a, tl.load(u_ptrs, mask=w_ok, other=0.0), up)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w2_kernel(
    act_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, num_pairs, H, INTER,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)
    tile, pn = _tile_and_column_block(H, BLOCK_N)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k + k0 < INTER
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    out = out_ptr + pair[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@functools.cache
def _table(device_index: int) -> MoETable:
    return moe_table(torch.cuda.get_device_name(device_index))


def config_for(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoEConfig:
    """The launch table's config for this call (default configs off CUDA: the interpreter)."""
    shape = (w13.shape[0], w13.shape[2], w13.shape[1] // 2, top_k)
    table = _table(x.device.index or 0) if x.is_cuda else {}
    return moe_config(table, shape, x.shape[0])


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, first: int = 0, num_experts: int | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) over the experts
    [first, first + E_local) that w13 [E_local, 2I, H] and w2 [E_local, H, I] hold, of the
    model's `num_experts` (default: these)."""
    T, H = x.shape
    num_local, two_i, _ = w13.shape
    top_k, inter = topk_ids.shape[1], two_i // 2
    cfg = config or config_for(x, w13, top_k)
    if cfg.gemv:
        return gemv_moe(x, w13, w2, topk_weights, topk_ids, first, num_experts, cfg)
    n = T * top_k
    pairs, tile_expert = align(topk_ids, first, num_local, cfg.block_m)
    tiles = tile_expert.numel()
    x = x.contiguous()
    act = torch.empty(tiles * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x))
    blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    _w13_kernel[(tiles * triton.cdiv(inter, cfg.block_n),)](
        x, w13, act, pairs, tile_expert, n, top_k, H, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), **blocks, **launch,
    )  # fmt: skip
    # pairs routed to other ranks' experts (expert parallel) keep their zero rows
    every_expert_here = num_local == (num_experts or num_local)
    out = (torch.empty if every_expert_here else torch.zeros)(n, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.float().contiguous()
    _w2_kernel[(tiles * triton.cdiv(H, cfg.block_n),)](
        act, w2, out, pairs, tile_expert, weights, n, H, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), **blocks, **launch,
    )  # fmt: skip
    return out.view(T, top_k, H).sum(dim=1)
