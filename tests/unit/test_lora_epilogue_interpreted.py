"""The skinny GEMM with LoRA products in its epilogue (`skinny_linear(lora=...)`, the shrunk rows
of `lora_sgmv.shrunk_rows`) in Triton's interpreter on the CPU, against float64 products of the
base weight and each token's adapter: q/k/v parts (with a bias and an input norm), a split-K
projection into a residual with the next norm's sums, the gated gate/up product, and the rotary
epilogue (against the same launch without rotary, then `rope.rotary_store`). Tokens of every
slot and base tokens; a rank below the tensor cores' 16. In fp16 (the interpreter's bf16
products are wrong)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.tolerance import assert_within_steps, reduction_atol
from tests.unit.test_skinny_gemm_interpreted import interpreted

DTYPE, SLOTS, RANK = torch.float16, 3, 8


def _adapters(gen: torch.Generator, m: int, k: int, out_parts: list[int]) -> tuple:
    """Random stacks (A [slots, parts x rank, k], B [out, slots, rank]) and a one-hot mask of m
    tokens over the slots, every (SLOTS + 1)th token a base one."""
    a = (torch.randn(SLOTS, len(out_parts) * RANK, k, generator=gen) / k**0.5).to(DTYPE)
    b = (torch.randn(sum(out_parts), SLOTS, RANK, generator=gen) / RANK**0.5).to(DTYPE)
    token_slots = torch.arange(m) % (SLOTS + 1) - 1
    mask = torch.zeros(m, SLOTS)
    live = token_slots >= 0
    mask[live.nonzero().flatten(), token_slots[live]] = 1.0
    return a, b, mask.to(DTYPE)


def _reference(
    x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
    out_parts: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x W^T plus each token's products in float64, and the sums of the terms' magnitudes."""
    from workers.kernels.lora_ops import masked_add_lora

    x64, w64 = x.double(), w.double()
    full = masked_add_lora(x64, x64 @ w64.T, a.double(), b.double(), mask.double(), out_parts)
    mags = masked_add_lora(x64.abs(), x64.abs() @ w64.abs().T, a.double().abs(),
                           b.double().abs(), mask.double(), out_parts)  # fmt: skip
    return full, mags


def check() -> None:
    """Each launch against the float64 reference; run with TRITON_INTERPRET=1."""
    from workers.kernels.lora_sgmv import shrunk_rows
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS
    from workers.kernels.tuning import Config

    gen, eps = torch.Generator().manual_seed(3), 1e-5
    cases = [  # (rows, K, output parts, config fields, gated, split-K into a residual)
        (7, 96, [64, 32, 32], dict(block_n=32, block_k=32, num_stages=2, dot=True), False),
        (19, 130, [80], dict(block_n=16, block_k=32, dot=True, swap=True, split_k=2), False),
        (5, 64, [48, 48], dict(block_n=32, block_k=32, num_stages=2, dot=True), True),
    ]
    for m, k, out_parts, fields, gated in cases:
        cfg, n = Config(**fields), sum(out_parts)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE)
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        a, b, mask = _adapters(gen, m, k, out_parts)
        lora = shrunk_rows(x, a, b, mask, out_parts)
        full, mags = _reference(x, w, a, b, mask, out_parts)
        if len(out_parts) == 3:  # q/k/v: a bias and an input norm (x the raw stream)
            bias = torch.randn(n, generator=gen).to(DTYPE)
            sums = torch.zeros(m, SUMSQ_SLOTS, dtype=torch.float64)
            sums[:, 1] = x.double().square().sum(-1)
            inv_rms = torch.rsqrt(sums.sum(-1, keepdim=True) / k + eps)
            got = skinny_linear(x, w, bias, config=cfg, sumsq_in=sums, eps=eps, lora=lora)
            want, scale = full * inv_rms + bias.double(), mags * inv_rms + bias.double().abs()
        elif gated:
            got = skinny_linear(x, w, config=cfg, gated=True, lora=lora)
            gate, up = (p.to(DTYPE).double() for p in full.chunk(2, -1))
            want, scale = F.silu(gate).to(DTYPE).double() * up, mags[:, :48] * mags[:, 48:]
        else:  # split-K, the residual added, the squares of the sum's rows out
            res = torch.randn(m, n, generator=gen).to(DTYPE)
            sums_out = torch.zeros(m, SUMSQ_SLOTS, dtype=torch.float64)
            got = skinny_linear(x, w, config=cfg, residual=res, sumsq_out=sums_out, lora=lora)
            want, scale = full + res.double(), mags + res.double().abs()
            assert torch.allclose(sums_out.sum(-1), got.double().square().sum(-1), rtol=1e-12)
        atol = reduction_atol(k + RANK, float(scale.max()), DTYPE)
        atol += float(torch.finfo(DTYPE).eps * scale.max())  # gate and up rounded apart
        err = float((got.double() - want).abs().max())
        assert err < atol, (m, k, out_parts, gated, err, atol)


def check_rotary() -> None:
    """The rotary epilogue with LoRA products against the same launch without rotary, then
    `rope.rotary_store`: the same q and pool bytes."""
    from workers.kernels import rope
    from workers.kernels.lora_sgmv import shrunk_rows
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.tuning import Config

    dim, hq, hkv, k, m, pages, page_size = 32, 4, 2, 64, 6, 4, 8
    gen = torch.Generator().manual_seed(4)
    out_parts = [hq * dim, hkv * dim, hkv * dim]
    w = (torch.randn(sum(out_parts), k, generator=gen) / k**0.5).to(DTYPE)
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    a, b, mask = _adapters(gen, m, k, out_parts)
    lora = shrunk_rows(x, a, b, mask, out_parts)
    cfg = Config(block_n=16, block_k=32, num_stages=2, dot=True)
    angles = torch.rand(m, 1, dim // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DTYPE) for f in (torch.cos, torch.sin))
    slots = torch.randperm(pages * page_size, generator=gen)[:m]
    pools = [torch.randn(pages, 2, page_size, hkv, dim, generator=gen).to(DTYPE)]
    pools.append(pools[0].clone())
    store = rope.RotaryStore(cos, sin, pools[0], slots // page_size, slots % page_size, 1.0, 1.0,
                             hq)  # fmt: skip
    q = skinny_linear(x, w, config=cfg, rotary=store, lora=lora)
    qs, ks, vs = skinny_linear(x, w, config=cfg, lora=lora).split(out_parts, -1)
    expect = rope.rotary_store(
        qs.view(m, hq, dim), ks.view(m, hkv, dim), vs.view(m, hkv, dim), cos, sin, pools[1],
        slots // page_size, slots % page_size, 1.0, 1.0,
    )  # fmt: skip
    assert_within_steps(q.view(m, hq, dim), expect, steps=2)
    assert_within_steps(pools[0], pools[1])


def test_lora_epilogue_interpreted() -> None:
    interpreted("check", __name__)


def test_lora_rotary_epilogue_interpreted() -> None:
    interpreted("check_rotary", __name__)
