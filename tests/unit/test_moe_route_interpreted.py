"""The MoE router's fused top-k (`workers/kernels/moe_route.py`) in Triton's interpreter on the
CPU, against torch's softmax + topk (+ renormalisation): expert counts that are and are not a
power of two, k of 1, 2 and 8, rows in a strided view."""

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
