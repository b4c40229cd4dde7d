"""An MoE router's top-k in one Triton launch: each row's softmax over the experts' logits (in
float32), its k largest probabilities with their expert ids, renormalised over the k where the
family says so. torch takes four launches for this (softmax, topk, sum, divide), each a graph
node of ~2-3 us at decode batch sizes, in every sparse layer of a step.

A program takes one row: the k largest by k rounds of max-and-knock-out, ties to the lowest
expert id. Ids come out in decreasing probability, as `torch.topk`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs


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
    logits = logits.to(tl.float32)
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
