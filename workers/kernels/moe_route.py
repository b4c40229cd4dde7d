"""An MoE router's top-k in one Triton launch: each row's softmax over the experts' logits (in
float32), its k largest probabilities with their expert ids, renormalised over the k where the
family says so. torch takes four launches for this (softmax, topk, sum, divide), each a graph
node of ~2-3 us at decode batch sizes, in every sparse layer of a step.

A program takes one row: the k largest by k rounds of max-and-knock-out, ties to the lowest
expert id. Ids come out in decreasing probability, as `torch.topk`'s.

`route_fused` (decode, at most FUSED_MAX_TOKENS rows) also takes the router GEMM that precedes
it, saving that launch: a program per (row, EXPERTS_PER_PROGRAM experts) computes its logits as a
GEMV (float32 sums), stores them to a scratch row, and counts itself in on the row's counter; the
last program of the row to arrive (acq_rel) reads the whole row back, selects as above and
resets the counter for the next launch (a graph's replay). Each logit is rounded to the model's
dtype before the float32 softmax, as torch.mm's output is and as HF's router computes it: ids then
equal `route_top_k(torch.mm(x, W.t()))`'s except where a float32 sum lies at a rounding boundary
and its two orders of summation round apart (one step, and a different id only where that step
decides a near-tie), and greedy tokens keep parity with HF's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.arrivals import arrival_counters
from workers.kernels.pdl import start_dependents, wait_for_inputs


@triton.jit
def _select_top_k(
    logits, e, num_experts, weights_ptr, ids_ptr, row,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """Row `row`'s softmax of `logits` [E_PAD] (float32; -inf past num_experts), its TOP_K
    largest probabilities (renormalised where asked) and their experts stored."""
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    valid = tl.where(e < num_experts, probs, -1.0)
    total = 1.0
    if RENORMALIZE:  # a first pass for the k's sum: no store is read back
        total = 0.0
        left = valid
        for _ in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            total += best
            left = tl.where(e == tl.min(tl.where(left == best, e, E_PAD), axis=0), -1.0, left)
    left = valid
    for i in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, E_PAD), axis=0)
        tl.store(weights_ptr + row * TOP_K + i, best / total)
        tl.store(ids_ptr + row * TOP_K + i, pick.to(tl.int64))
        left = tl.where(e == pick, -1.0, left)


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    wait_for_inputs(PDL)  # the router's logits
    row = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + row * stride + e, mask=e < num_experts, other=-float("inf"))
    _select_top_k(logits.to(tl.float32), e, num_experts, weights_ptr, ids_ptr, row,
                  TOP_K, E_PAD, RENORMALIZE)  # fmt: skip


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr, num_experts, H, stride_x,
    stride_w, TOP_K: tl.constexpr, E_PAD: tl.constexpr, EXPERTS: tl.constexpr,
    BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    row, block = tl.program_id(0), tl.program_id(1)
    offs_e = block * EXPERTS + tl.arange(0, EXPERTS)
    e_ok = offs_e < num_experts
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    # The first tile of the router's weight streams in before x, the previous kernel's output,
    # is ready (PDL)
    w = tl.load(w_ptrs, mask=e_ok[:, None] & (offs_k < H)[None, :], other=0.0)
    wait_for_inputs(PDL)
    x_ptrs = x_ptr + row.to(tl.int64) * stride_x + offs_k
    x = tl.load(x_ptrs, mask=offs_k < H, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, H, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_ok = offs_k + k0 < H
        w = tl.load(w_ptrs, mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    # rounded to the model's dtype, as torch.mm's logits (and HF's) are before the softmax
    logit = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + row * num_experts + offs_e, logit, mask=e_ok)
    tl.debug_barrier()  # every thread's logits are written before the count goes up
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        e = tl.arange(0, E_PAD)
        logits = tl.load(logits_ptr + row * num_experts + e, mask=e < num_experts,
                         other=-float("inf"), cache_modifier=".cg")  # fmt: skip
        _select_top_k(logits, e, num_experts, weights_ptr, ids_ptr, row, TOP_K, E_PAD,
                      RENORMALIZE)  # fmt: skip
        tl.atomic_xchg(count_ptr + row, 0)  # for the next launch


def route_top_k(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` [T, experts] -> (weights [T, k] float32, ids [T, k] int64), as
    `softmax(logits, float32)`, `topk`, and the optional renormalisation."""
    tokens, num_experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    _route_kernel[(tokens,)](
        logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
        E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
        **pdl.launch_options(logits),
    )  # fmt: skip
    return weights, ids


FUSED_MAX_TOKENS = 16  # rows `route_fused` takes: each re-reads the router's weight (from L2)
EXPERTS_PER_PROGRAM = 4  # 32 programs a row at 128 experts: enough to spread the weight's reads


def route_fused(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
    experts_per_program: int = EXPERTS_PER_PROGRAM, block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`route_top_k(torch.mm(x, weight.t()), top_k, renormalize)` in one launch for x [T, H]
    (T <= FUSED_MAX_TOKENS) and the router's weight [experts, H]: (weights [T, k] float32, ids
    [T, k] int64). Logits are float32 sums rounded to x's dtype (the module's docstring)."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if tokens > FUSED_MAX_TOKENS:
        raise ValueError(f"route_fused takes at most {FUSED_MAX_TOKENS} rows, not {tokens}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()  # a parameter: already
    logits = torch.empty((tokens, num_experts), dtype=torch.float32, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    if tokens == 0:
        return weights, ids
    block_k = block_k or min(512, triton.next_power_of_2(hidden))
    counters = arrival_counters("route_fused", FUSED_MAX_TOKENS, x.device)  # one a row
    _router_kernel[(tokens, triton.cdiv(num_experts, experts_per_program))](
        x, weight, logits, counters, weights, ids, num_experts, hidden,
        x.stride(0), weight.stride(0), TOP_K=top_k, E_PAD=triton.next_power_of_2(num_experts),
        EXPERTS=experts_per_program, BLOCK_K=block_k, RENORMALIZE=renormalize, num_warps=4,
        **pdl.launch_options(x),
    )  # fmt: skip
    return weights, ids
