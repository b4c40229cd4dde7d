"""The fused MoE kernel (`workers/kernels/moe_fused.py`) in Triton's interpreter on the CPU,
against the torch path (`moe_experts.grouped_experts`): every expert, and an expert-parallel
rank's range; tiles of 16 and 32 pairs; shapes that no block divides. In fp16 (the interpreter's
bf16 products are wrong). The GPU test is tests/gpu/test_moe_gpu.py."""

from __future__ import annotations

import torch

from tests.tolerance import reduction_atol
from tests.unit.test_skinny_gemm_interpreted import interpreted

CASES = [  # (tokens, experts held, first expert, Config fields)
    (5, 6, 0, dict(block_m=16, block_n=16, block_k=32, num_stages=1)),
    (11, 3, 3, dict(block_m=32, block_n=32, block_k=16, num_stages=1)),  # rank 1 of 2
    (530, 6, 0, dict(block_m=64, block_n=32, block_k=32, num_stages=1)),  # > 1024 pairs: chunks
]


def check() -> None:
    """Each case against the torch path in float64; run with TRITON_INTERPRET=1."""
    from workers.kernels.moe_fused import fused_moe
    from workers.kernels.moe_tuning import MoEConfig

    dtype, E, H, inter, k = torch.float16, 6, 40, 24, 2  # H, I: tails of every block
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype)
    for tokens, held, first, fields in CASES:
        cfg = MoEConfig(**fields)
        x = torch.randn(tokens, H, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
        mine = slice(first, first + held)
        out = fused_moe(x, w13[mine], w2[mine], weights, ids, first, E, cfg)
        assert_matches_torch_path(out, x, w13[mine], w2[mine], weights, ids, first, fields)
        assert_aligned(ids, first, held, cfg.block_m)
    # more pairs than one program of the count takes, and than its last program sums at once
    from workers.kernels import moe_align

    many = moe_align.COUNT_CHUNK * (moe_align.ROWS + 2) // k + 5
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(many)])
    assert_aligned(ids, 0, E, 64)
    assert_aligned(ids, 2, 3, 16)


def assert_aligned(ids: torch.Tensor, first: int, held: int, block_m: int) -> None:
    """Each tile of an expert holds that expert's pairs then the sentinel; every routed pair of
    this rank is in exactly one slot; the tiles past the runs are marked -1."""
    from workers.kernels.moe_align import align

    n = ids.numel()
    pairs, tile_expert = align(ids, first, held, block_m)
    slots = pairs[:-1].view(-1, block_m)
    local = ids.flatten() - first
    experts = tile_expert.tolist()
    used = [tile for tile, e in zip(slots, experts) if e >= 0]
    assert all(e >= 0 for e in experts[: len(used)]) and all(e == -1 for e in experts[len(used) :])
    for tile, e in zip(used, experts):
        real = tile[tile < n]
        assert (tile[len(real) :] == n).all() and len(real) > 0
        assert (local[real] == e).all()
    routed = ((local >= 0) & (local < held)).nonzero().flatten()
    got = torch.cat(used) if used else torch.empty(0, dtype=torch.int32)
    assert sorted(got[got < n].tolist()) == routed.tolist()
    assert experts[: len(used)] == sorted(experts[: len(used)])


def test_fused_moe_equals_the_torch_path() -> None:
    interpreted("check", __name__)


def assert_matches_torch_path(
    out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor, first: int, label: object,
) -> None:  # fmt: skip
    """`out` against the torch path in float64 (`grouped_experts`), within float32 sums' error
    and two roundings to x's dtype (act, then each output row: once each)."""
    from workers.model.moe_experts import grouped_experts

    want = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids, first)
    assert out.shape == x.shape and out.dtype == x.dtype
    scale = _term_scale(x, w13, w2, weights, ids, first)
    eps = float(torch.finfo(x.dtype).eps)
    atol = reduction_atol(w2.shape[2], scale, x.dtype) + 2 * eps * scale
    err = float((out.double() - want).abs().max())
    assert err < atol, (label, err, atol)


def _term_scale(x, w13, w2, weights, ids, first) -> float:  # noqa: ANN001 - tensors
    """The largest sum of term magnitudes of a token's output: sum_k w_k |W2_k| @ |act_k|."""
    scale = 0.0
    for t in range(x.shape[0]):
        total = torch.zeros(w2.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e].double() @ x[t].double()).chunk(2)
                act = torch.nn.functional.silu(gate) * up
                total += float(weights[t, j]) * (w2[e].double().abs() @ act.abs())
        scale = max(scale, float(total.max()))
    return scale


def test_launch_table_round_trips_and_picks_the_nearest_bucket() -> None:
    import json

    from workers.kernels.moe_tuning import MoEConfig, default_config, dumps, moe_config, parse

    a3b = (128, 2048, 768, 8)
    table = {a3b: {1: MoEConfig(16, 32, 128, 4, 4), 64: MoEConfig(32, 64, 64, 4, 3),
                   8192: MoEConfig(64, 128, 64, 8, 3)}}  # fmt: skip
    assert parse(json.loads(dumps(table, "NVIDIA H200"))) == table
    assert moe_config(table, a3b, 1) == table[a3b][1]
    assert moe_config(table, a3b, 3) == table[a3b][1]  # bucket 4: nearer 1 than 64
    assert moe_config(table, a3b, 50) == table[a3b][64]
    assert moe_config(table, a3b, 100_000) == table[a3b][8192]
    assert moe_config(table, (64, 2048, 768, 8), 1) == default_config(1, 8, 64)  # not measured


def test_launch_table_keeps_gemv_configs_and_reads_tables_without_them() -> None:
    import json

    from workers.kernels.moe_tuning import MoEConfig, dumps, moe_config, parse

    a3b = (128, 2048, 768, 8)
    gemv = MoEConfig(block_n=8, block_k=512, num_warps=2, num_stages=1, gemv=True)
    own_down = MoEConfig(block_n=4, block_k=512, num_warps=1, num_stages=2, gemv=True,
                         down_slots=True, down=(4, 128, 4, 1))  # fmt: skip
    table = {a3b: {1: own_down, 2: gemv, 64: MoEConfig(32, 64, 64, 4, 3)}}
    text = dumps(table, "NVIDIA H200")
    assert parse(json.loads(text)) == table
    # written only where set
    assert text.count('"gemv"') == 2 and text.count('"down"') == 1
    assert moe_config(table, a3b, 2) == gemv and not moe_config(table, a3b, 50).gemv
    # a table written before the fields: read as the aligned kernels', written back unchanged
    before = dumps({a3b: {64: MoEConfig(32, 64, 64, 4, 3)}}, "NVIDIA H100 80GB HBM3")
    assert '"gemv"' not in before and '"down' not in before
    old = parse(json.loads(before))
    assert not any(c.gemv or c.down for per_bucket in old.values() for c in per_bucket.values())
    assert dumps(old, "NVIDIA H100 80GB HBM3") == before
