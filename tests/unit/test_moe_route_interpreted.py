"""The MoE router's fused top-k (`workers/kernels/moe_route.py`) in Triton's interpreter on the
CPU, against torch's softmax + topk (+ renormalisation): expert counts that are and are not a
power of two, k of 1, 2 and 8, rows in a strided view. And `route_fused` (the router GEMM too)
against torch.mm + `route_top_k`, twice over the same row counters."""

from __future__ import annotations

import torch

from tests.unit.test_skinny_gemm_interpreted import interpreted

CASES = [(5, 128, 8, True), (3, 8, 2, False), (4, 60, 1, True), (2, 60, 6, False)]


def check() -> None:
    """Each case: the same ids and float32 weights; run with TRITON_INTERPRET=1."""
    from workers.kernels.moe_route import route_top_k

    gen = torch.Generator().manual_seed(0)
    for tokens, experts, k, renormalize in CASES:
        wide = torch.randn(tokens, experts + 3, generator=gen).to(torch.float16)
        logits = wide[:, :experts]  # rows strided
        weights, ids = route_top_k(logits, k, renormalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        want_w, want_ids = torch.topk(probs, k, dim=-1)
        if renormalize:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids, want_ids), (tokens, experts, k)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_route_top_k_equals_torch() -> None:
    interpreted("check", __name__)


FUSED_CASES = [  # (tokens, experts, k, renormalize, hidden, block_k, experts a program)
    (5, 128, 8, True, 200, 64, 4),
    (3, 8, 2, False, 96, 32, 4),
    (16, 60, 1, True, 200, 256, 8),  # FUSED_MAX_TOKENS rows; a tail block of experts
    (2, 10, 6, False, 40, 16, 4),
]


def check_fused() -> None:
    """Each case twice (new x, the counters as the first call left them): the same ids as
    torch.mm + route_top_k; on inputs whose float32 sums are exact, the same weights bit for bit
    (the logits rounded to fp16 as torch.mm's), else within a step of fp16 in each logit. Run
    with TRITON_INTERPRET=1."""
    from workers.kernels.moe_route import route_fused, route_top_k

    gen = torch.Generator().manual_seed(1)
    for tokens, experts, k, renormalize, hidden, block_k, per_program in FUSED_CASES:
        w = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(torch.float16)
        w_exact = (torch.randint(-16, 17, (experts, hidden), generator=gen) / 32).half()
        for call in range(2):
            x = torch.randn(tokens, hidden, generator=gen).to(torch.float16)
            x_exact = (torch.randint(-32, 33, (tokens, hidden), generator=gen) / 8).half()
            for xs, ws, exact in ((x, w, False), (x_exact, w_exact, True)):
                weights, ids = route_fused(xs, ws, k, renormalize, per_program, block_k)
                logits = torch.mm(xs, ws.t())
                want_w, want_ids = route_top_k(logits, k, renormalize)
                assert ids.dtype == torch.int64 and weights.dtype == torch.float32
                assert torch.equal(ids, want_ids), (tokens, experts, k, call, exact)
                # exact: multiples of 2^-8 below 2^9 (17 bits), so every order sums them exactly,
                # and most need more than fp16's 11 bits: the rounding shows in the weights
                if exact:
                    assert torch.equal(weights, want_w), (tokens, experts, call)
                else:
                    step = float(torch.finfo(torch.float16).eps * logits.abs().max())
                    torch.testing.assert_close(weights, want_w, rtol=4 * step, atol=1e-7)


def test_route_fused_equals_mm_and_route_top_k() -> None:
    interpreted("check_fused", __name__)
