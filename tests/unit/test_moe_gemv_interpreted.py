"""The small-batch MoE GEMV kernels (`workers/kernels/moe_gemv.py`) in Triton's interpreter on the
CPU, against the torch path (`moe_experts.grouped_experts`) in float64: 1, 3 and 5 tokens, every
expert and expert-parallel ranges (a token with no local expert gets a zero row), two tokens
sharing an expert, shapes that no block divides, both forms of the down kernel; and
`fused_moe`'s dispatch to them. In fp16 and
bf16: the interpreter's bf16 products are wrong only in tl.dot, which these kernels do not use.
The GPU test is tests/gpu/test_moe_gpu.py."""

from __future__ import annotations

import torch

from tests.unit.test_moe_fused_interpreted import assert_matches_torch_path
from tests.unit.test_skinny_gemm_interpreted import interpreted

E, H, INTER = 6, 40, 24  # H, I: tails of every block below
CASES = [  # (tokens, top_k, experts held, first expert, MoEConfig fields)
    (1, 2, 6, 0, dict(block_n=16, block_k=32)),
    (3, 2, 3, 3, dict(block_n=8, block_k=16, num_warps=2)),  # rank 1 of 2
    (5, 3, 2, 2, dict(block_n=32, block_k=64, num_warps=1, num_stages=2)),  # a middle range
    (5, 2, 6, 0, dict(block_n=16, block_k=16, num_stages=2)),
    # the down kernel with all slots in one tile: top-k 3 (padded to 4 slots), ranks, a tail
    (1, 3, 6, 0, dict(block_n=4, block_k=16, down_slots=True)),
    (3, 2, 3, 3, dict(block_n=8, block_k=32, num_warps=2, down_slots=True)),
    (5, 3, 2, 2, dict(block_n=16, block_k=16, num_stages=2, down_slots=True)),
    # the down kernel's own tiles (`MoEConfig.down`), either form
    (3, 2, 6, 0, dict(block_n=16, block_k=32, down=(4, 16, 2, 2))),
    (3, 3, 3, 3, dict(block_n=8, block_k=16, down_slots=True, down=(2, 64, 1, 1))),
]


def _routing(tokens: int, k: int, first: int, held: int, gen: torch.Generator) -> torch.Tensor:
    """Random distinct experts a token, with token 0 routed to none of [first, first + held)
    where that leaves k others, and tokens 1 and 2 sharing an expert of that range."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    others = [e for e in range(E) if not first <= e < first + held]
    if len(others) >= k:
        ids[0] = torch.tensor(others[:k])
    if tokens >= 3:
        shared = first + held - 1
        for t in (1, 2):
            if shared not in ids[t]:
                ids[t, -1] = shared
    return ids


def check() -> None:
    """Each case against the torch path in float64; run with TRITON_INTERPRET=1."""
    for dtype in (torch.float16, torch.bfloat16):
        _check(dtype)


def _check(dtype: torch.dtype) -> None:
    from workers.kernels.moe_fused import fused_moe
    from workers.kernels.moe_gemv import gemv_moe
    from workers.kernels.moe_tuning import GEMV_DEFAULT, MoEConfig

    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype)
    for tokens, k, held, first, fields in CASES:
        cfg = MoEConfig(**fields, gemv=True)
        x = torch.randn(tokens, H, generator=gen).to(dtype)
        ids = _routing(tokens, k, first, held, gen)
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
        mine = slice(first, first + held)
        out = gemv_moe(x, w13[mine], w2[mine], weights, ids, first, E, cfg)
        assert_matches_torch_path(out, x, w13[mine], w2[mine], weights, ids, first,
                                  (dtype, fields))  # fmt: skip
        local = (ids >= first) & (ids < first + held)
        assert local.any(dim=1).any()  # some token has a local expert
        none_here = ~local.any(dim=1)
        if held < E:
            assert bool(none_here[0]), ids  # the case covers a token with no local expert
        assert (out[none_here] == 0).all()  # written, as zeros
        # the aligned path's config picks the same kernels: the same bits
        same = fused_moe(x, w13[mine], w2[mine], weights, ids, first, E, cfg)
        assert torch.equal(same, out)
    # fused_moe's own choice at batch 1 (the default table): the GEMV kernels
    x, ids = torch.randn(1, H, generator=gen).to(dtype), torch.tensor([[4, 1]])
    weights = torch.tensor([[0.7, 0.3]])
    out = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, gemv_moe(x, w13, w2, weights, ids, config=GEMV_DEFAULT))


def test_gemv_moe_equals_the_torch_path() -> None:
    interpreted("check", __name__)


def test_default_config_takes_the_gemv_path_up_to_half_the_experts() -> None:
    from workers.kernels.moe_tuning import GEMV_DEFAULT, default_config

    # Qwen3-30B-A3B: 128 experts, top-8 -> batch 1-8; its expert-parallel half -> 1-4
    assert [default_config(t, 8, 128).gemv for t in (1, 8, 9, 64)] == [True, True, False, False]
    assert [default_config(t, 8, 64).gemv for t in (4, 5)] == [True, False]
    assert default_config(1, 2, 8) == GEMV_DEFAULT  # Mixtral: batch 1-2
    assert not default_config(3, 2, 8).gemv
