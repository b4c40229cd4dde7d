"""The skinny GEMM's epilogues in Triton's interpreter on the CPU: the gated launch
(`skinny_linear(gated=True)`: silu(gate) * up of a [gate; up] weight) on both kernels against the
GEMM followed by the activation, and the rotary one (`skinny_linear(rotary=...)`) against the GEMM
followed by `rope.rotary_store`. In fp16: the interpreter's bf16 tensor-core
products come out wrong (~1e11 for unit inputs), its fp16 ones do not. The GPU
tests are tests/gpu/test_skinny_gemm.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO
from tests.tolerance import assert_within_steps, reduction_atol

pytest.importorskip("triton")

CONFIGS = [  # (rows, Config fields): the GEMV kernel, the tensor-core kernel either way round
    (3, dict(block_n=8, block_k=64)),
    (16, dict(block_n=64, block_k=64, num_stages=2, dot=True, swap=True)),
    (33, dict(block_n=32, block_k=64, num_stages=2, dot=True)),
]


def check() -> None:
    """Each config's gated launch against the unfused product; run with TRITON_INTERPRET=1."""
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.tuning import Config

    dtype = torch.float16
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 200  # a tail tile of N and a K that no tile divides
    w = (torch.randn(2 * n, k, generator=gen) / k**0.5).to(dtype)
    for m, fields in CONFIGS:
        cfg = Config(**fields)
        x = torch.randn(m, k, generator=gen).to(dtype)
        out = skinny_linear(x, w, config=cfg, gated=True)
        assert out.shape == (m, n) and out.dtype == dtype
        gate, up = (p.to(dtype).double() for p in (x.double() @ w.double().T).chunk(2, -1))
        expect = F.silu(gate).to(dtype).double() * up
        # One fp16 rounding of the product dominates K = 200's float32 sums.
        atol = reduction_atol(k, float(expect.abs().max()), dtype)
        err = float((out.double() - expect).abs().max())
        assert err < atol, (fields, err, atol)


def interpreted(check_name: str, module: str = __name__) -> None:
    """Run `check_name` of `module` in a process of its own: Triton reads TRITON_INTERPRET
    where a function is decorated."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    code = f"from {module} import {check_name}; {check_name}()"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_gated_product_interpreted() -> None:
    interpreted("check")


ROTARY_CONFIGS = [  # (rows, Config fields): tiles of a whole head and of half of one
    (16, dict(block_n=32, block_k=32, num_stages=2, dot=True, swap=True)),
    (19, dict(block_n=16, block_k=32, num_stages=2, dot=True)),
]


def check_rotary() -> None:
    """The rotary epilogue (`skinny_linear(rotary=...)`) against the same kernel's q/k/v product
    then `rope.rotary_store`: the same q and pool bytes, into an FP8 and a 16-bit pool, with a
    bias and an input norm; every other slot of the pool untouched."""
    from workers.kernels import rope
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS
    from workers.kernels.tuning import Config

    dtype, dim, hq, hkv, k, pages, page_size = torch.float16, 32, 4, 2, 64, 6, 8
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn((hq + 2 * hkv) * dim, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype)
    for m, fields in ROTARY_CONFIGS:
        cfg = Config(**fields)
        x = torch.randn(m, k, generator=gen).to(dtype)
        sums = torch.zeros(m, SUMSQ_SLOTS, dtype=torch.float64)
        sums[:, 0] = x.double().square().sum(-1)
        angles = torch.rand(m, 1, dim // 2, generator=gen) * 6
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        slots = torch.randperm(pages * page_size, generator=gen)[:m]
        slot_pages, slot_offsets = slots // page_size, slots % page_size
        for kv_dtype, k_scale, v_scale in ((torch.float8_e4m3fn, 0.05, 0.1), (dtype, 1.0, 1.0)):
            pools = [torch.randn(pages, 2, page_size, hkv, dim, generator=gen).to(kv_dtype)]
            pools.append(pools[0].clone())
            store = rope.RotaryStore(
                cos, sin, pools[0], slot_pages, slot_offsets, k_scale, v_scale, hq
            )
            q = skinny_linear(x, w, bias, config=cfg, sumsq_in=sums, eps=1e-5, rotary=store)
            qkv = skinny_linear(x, w, bias, config=cfg, sumsq_in=sums, eps=1e-5)
            qs, ks, vs = qkv.split([hq * dim, hkv * dim, hkv * dim], -1)
            expect = rope.rotary_store(
                qs.view(m, hq, dim), ks.view(m, hkv, dim), vs.view(m, hkv, dim), cos, sin,
                pools[1], slot_pages, slot_offsets, k_scale, v_scale,
            )  # fmt: skip
            # The same float32 arithmetic, but the interpreter's order of it may differ by CPU:
            # a value rounded to fp16 (q) or FP8 (the pool) may land one step apart. The
            # reference also rounds q to fp16 before rotating it (the epilogue rotates the
            # float32 sums): a second step where the rotation's two terms partly cancel.
            assert_within_steps(q.view(m, hq, dim), expect, steps=2)
            written = torch.zeros(pages * page_size, dtype=torch.bool)
            written[slots] = True
            written = written.view(pages, 1, page_size, 1, 1).expand_as(pools[0])
            assert_within_steps(pools[0][written], pools[1][written])
            # Both pools started as one copy: the epilogue wrote rotary_store's slots, no more.
            assert torch.equal(
                pools[0][~written].view(torch.uint8), pools[1][~written].view(torch.uint8)
            )


def test_rotary_epilogue_interpreted() -> None:
    interpreted("check_rotary")


def check_blocked() -> None:
    """A weight in blocks of rows (`weight_blocks`): the tensor-core kernel either way round and
    the GEMV kernel, gated or not, tiles of a block, of two and of part of one, give the bits
    they give for the row-major weight (K split into tiles unevenly, as in `check`)."""
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.tuning import Config
    from workers.kernels.weight_blocks import block_rows

    dtype = torch.float16
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(128, 200, generator=gen) / 200**0.5).to(dtype)
    blocked = w.clone()
    block_rows(blocked, 32)
    dots = [(m, Config(block_n=bn, block_k=64, num_stages=2, dot=True, swap=swap))
            for m, bn, swap in ((16, 64, True), (33, 32, False), (2, 64, False))]  # fmt: skip
    gemvs = [(m, Config(block_n=bn, block_k=bk, num_warps=2, num_stages=2))
             for m, bn, bk in ((1, 32, 64), (1, 16, 32), (3, 64, 64))]  # fmt: skip
    for m, cfg in dots + gemvs:
        x = torch.randn(m, 200, generator=gen).to(dtype)
        for gated in (False, True):
            expect = skinny_linear(x, w, config=cfg, gated=gated)
            got = skinny_linear(x, blocked, config=cfg, gated=gated)
            assert torch.equal(got, expect), (m, cfg, gated)


def test_blocked_weight_interpreted() -> None:
    interpreted("check_blocked")
