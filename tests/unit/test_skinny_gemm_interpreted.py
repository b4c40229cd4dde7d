"""The skinny GEMM's gated launch (`skinny_gemm.skinny_linear(gated=True)`: silu(gate) * up of a
[gate; up] weight in the GEMM's epilogue) in Triton's interpreter on the CPU, on both kernels,
against the GEMM followed by the activation. In fp16: the interpreter's bf16 tensor-core
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
        err = float((out.double() - expect).abs().max() / expect.abs().max())
        assert err < 2 * 2**-11, (fields, err)


def test_gated_product_interpreted() -> None:
    """In a process of its own: Triton reads TRITON_INTERPRET where a function is decorated."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    code = f"from {__name__} import check; check()"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
