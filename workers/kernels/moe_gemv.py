"""MoE experts at batch 1-8 (Triton): two GEMV launches a layer, no alignment, no reduce.

At decode batch sizes each routed expert sees about one (token, slot) pair, so the aligned path
(`moe_fused.py`) pads every pair to a 16-row tile and spends four of its five launches (two
alignment kernels, the top-k sum) on bookkeeping; at batch 1 those boundaries, not the weight
reads, bound the layer. Here:
1. `_w13_gemv_kernel`, a program per (pair, BLOCK_N rows of I): the pair's expert read from the
   routing's ids, its gate and up rows times the token's row of x, SiLU(gate) * up -> act [pairs,
   I]. A pair whose expert another rank holds (expert parallel) returns at once. Two pairs routed
   to one expert each read its weights; at these batch sizes that is rare, and as the pairs'
   programs run side by side the second read comes from L2.
2. `_w2_gemv_kernel`, a program per (token, BLOCK_N rows of H): over the token's k slots in
   order, each local expert's down rows times its pair's act row, scaled by the routing weight,
   summed in float32 and stored once: the top-k sum is fused (no [pairs, H] buffer, no sum
   launch), deterministic, and a token none of whose experts is local gets a zero row.
Both are GEMVs (M = 1): each program multiplies [BLOCK_N, BLOCK_K] weight tiles elementwise into
a float32 accumulator of that shape, reduced once at the end (`skinny_gemv.py`'s loop), since
tl.dot would pad M to 16. Both use PDL as the other MoE kernels do; they read only after
`wait_for_inputs`, since which weights to read comes from the routing. Nothing allocates beyond
act and the output, nothing syncs the host: a decode step's calls can be captured in CUDA graphs.
`MoEConfig.gemv` (`moe_tuning`) picks this path for a token bucket; `moe_fused.fused_moe`
dispatches here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.moe_tuning import GEMV_DEFAULT, MoEConfig
from workers.kernels.pdl import start_dependents, wait_for_inputs


@triton.jit
def _w13_gemv_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, first, num_local, top_k, H, INTER,
    stride_x, stride_we, stride_wn, stride_act,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the pair's expert comes from the routing
    pair, pn = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64) - first
    if (expert < 0) | (expert >= num_local):
        return  # another rank's expert: its act row is never read
    token = (pair // top_k).to(tl.int64)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_x + offs_k
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn  # the up row of each gate row
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=LOOP_STAGES):
        k_ok = offs_k + k0 < H
        a = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_ok = n_ok[:, None] & k_ok[None, :]
        gate += tl.load(g_ptrs, mask=w_ok, other=0.0).to(tl.float32) * a
        up += tl.load(u_ptrs, mask=w_ok, other=0.0).to(tl.float32) * a
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    g = tl.sum(gate, axis=1)  # one reduction each, after the loop: no shuffles in it
    act = g / (1.0 + tl.exp(-g)) * tl.sum(up, axis=1)
    out = act_ptr + pair.to(tl.int64) * stride_act + offs_n
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _w2_gemv_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, first, num_local, top_k, H, INTER,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # act, and the routing before it
    token, pn = tl.program_id(0), tl.program_id(1)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    k_tiles = tl.cdiv(INTER, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # One loop over (slot, K tile), the slots in order: a single pipelined stream of weight
    # tiles and one accumulator for the whole weighted sum, reduced once at the end.
    for it in tl.range(0, top_k * k_tiles, num_stages=LOOP_STAGES):
        slot = it // k_tiles
        k0 = (it - slot * k_tiles) * BLOCK_K
        pair = token.to(tl.int64) * top_k + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64) - first
        mine = (expert >= 0) & (expert < num_local)
        expert = tl.where(mine, expert, 0)
        weight = tl.load(weights_ptr + pair)
        k_ok = offs_k + k0 < tl.where(mine, INTER, 0)  # another rank's expert: loads masked off
        a = tl.load(act_ptr + pair * stride_act + k0 + offs_k, mask=k_ok, other=0.0)
        a = a.to(tl.float32) * weight  # the routing weight on act's BLOCK_K, not on H's rows
        b = tl.load(w_ptr + expert * stride_we + k0 + rows, mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        acc += b.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, y.to(out_ptr.dtype.element_ty),
             mask=n_ok)  # fmt: skip


@triton.jit
def _w2_gemv_slots_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, first, num_local, top_k, H, INTER,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_P2: tl.constexpr,
    LOOP_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_w2_gemv_kernel` with the token's k slots in one tile: rows (slot, output row), each
    slot's expert and weight loaded once before the loop (no routing loads inside it), k x
    BLOCK_N weight rows in flight a K step; the slots summed after the loop, in order."""
    start_dependents(PDL)
    wait_for_inputs(PDL)  # act, and the routing before it
    token, pn = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, TOPK_P2 * BLOCK_N)
    slot = r // BLOCK_N
    offs_n = pn * BLOCK_N + r % BLOCK_N
    pair = token.to(tl.int64) * top_k + slot
    slot_ok = slot < top_k
    expert = tl.load(ids_ptr + pair, mask=slot_ok, other=-1).to(tl.int64) - first
    mine = slot_ok & (expert >= 0) & (expert < num_local) & (offs_n < H)
    expert = tl.where(mine, expert, 0)
    weight = tl.load(weights_ptr + pair, mask=slot_ok, other=0.0)
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
    a_rows = act_ptr + pair * stride_act  # a slot's act row, once per output row (cached)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((TOPK_P2 * BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, INTER, BLOCK_K, num_stages=LOOP_STAGES):
        ok = mine[:, None] & (offs_k + k0 < INTER)[None, :]  # another rank's expert: masked off
        a = tl.load(a_rows[:, None] + k0 + offs_k[None, :], mask=ok, other=0.0)
        b = tl.load(w_rows[:, None] + k0 + offs_k[None, :], mask=ok, other=0.0)
        acc += b.to(tl.float32) * a.to(tl.float32)
    y = tl.sum(acc, axis=1) * weight
    y = tl.sum(tl.reshape(y, (TOPK_P2, BLOCK_N)), axis=0)
    out_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + out_n, y.to(out_ptr.dtype.element_ty),
             mask=out_n < H)  # fmt: skip


def gemv_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, first: int = 0, num_experts: int | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """`moe_fused.fused_moe`'s result [T, H] in two launches: sum_k topk_weights[t, k] *
    expert_{topk_ids[t, k]}(x[t]) over the experts [first, first + E_local) that w13
    [E_local, 2I, H] and w2 [E_local, H, I] hold (each row's last dimension contiguous), of the
    model's `num_experts` (default: these). `config`'s block_n, block_k, num_warps and
    num_stages are gate/up's and, unless its `down` gives the down kernel's own, the down
    kernel's; its down_slots the down kernel's form (default: `moe_tuning.GEMV_DEFAULT`)."""
    T, H = x.shape
    num_local, two_i, _ = w13.shape
    top_k, inter = topk_ids.shape[1], two_i // 2
    if first < 0 or first + num_local > (num_experts or num_local):
        raise ValueError(f"experts [{first}, {first + num_local}) outside {num_experts}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights' rows must be contiguous")
    cfg = config or GEMV_DEFAULT
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)  # every element written
    if T == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.contiguous()  # no copies for the routing's own outputs
    weights = topk_weights.float().contiguous()
    act = torch.empty(T * top_k, inter, dtype=x.dtype, device=x.device)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x))
    tiles = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LOOP_STAGES=cfg.num_stages)
    _w13_gemv_kernel[(T * top_k, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, ids, first, num_local, top_k, H, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), **tiles, **launch,
    )  # fmt: skip
    down_args = (act, w2, out, ids, weights, first, num_local, top_k, H, inter,
                 act.stride(0), w2.stride(0), w2.stride(1), out.stride(0))  # fmt: skip
    if cfg.down is not None:
        block_n, block_k, warps, stages = cfg.down
        launch |= dict(num_warps=warps, num_stages=stages)
        tiles = dict(BLOCK_N=block_n, BLOCK_K=block_k, LOOP_STAGES=stages)
    grid = (T, triton.cdiv(H, tiles["BLOCK_N"]))
    if cfg.down_slots:
        slots = triton.next_power_of_2(top_k)
        _w2_gemv_slots_kernel[grid](*down_args, TOPK_P2=slots, **tiles, **launch)
    else:
        _w2_gemv_kernel[grid](*down_args, **tiles, **launch)
    return out
