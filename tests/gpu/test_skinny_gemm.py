"""The Triton skinny GEMM equals x W^T (+ bias) to 16-bit rounding, and replays in CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.tp import TPGroup

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Error within a couple of output roundings, relative to the output's scale."""
    assert out.dtype == dtype and out.shape == ref.shape
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 2 * eps, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n,k",
    [(4096, 4096), (6144, 4096), (100, 300), (1000, 1000), (333, 4104), (4096, 14336), (7, 64)],
)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 31, 32, 64])
def test_skinny_linear_matches_fp64_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    from workers.model.skinny_gemm import skinny_linear

    torch.manual_seed(m * 7919 + n + k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    assert_close(skinny_linear(x, w), reference(x, w), dtype)


SPLIT_CONFIGS = [
    dict(block_n=8, block_k=256, split_k=4),
    dict(block_n=64, block_k=128, num_stages=4, dot=True, swap=True, split_k=4),
    dict(block_n=32, block_k=128, num_stages=4, dot=True, split_k=8),
]


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS)
@pytest.mark.parametrize("n,k", [(4096, 14336), (333, 4104), (100, 300)])
@pytest.mark.parametrize("m", [1, 5, 33, 64])
def test_split_k_sums_the_partials_of_every_split(m: int, n: int, k: int, cfg: dict) -> None:
    from workers.model.skinny_gemm import MAX_GEMV_ROWS, Config, skinny_linear

    if not cfg.get("dot") and m > MAX_GEMV_ROWS:
        pytest.skip("the GEMV kernel takes few rows")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # the tile locks are back at zero after each launch
        assert_close(skinny_linear(x, w, b, Config(**cfg)), reference(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("m", [1, 4, 24])
def test_skinny_linear_adds_bias_and_reads_strided_rows(m: int) -> None:
    from workers.model.skinny_gemm import skinny_linear

    x = torch.randn(m, 2 * 1000, device="cuda", dtype=torch.bfloat16)[:, ::2]  # stride 2 in K
    rows = torch.randn(m, 1024 + 512, device="cuda", dtype=torch.bfloat16)[:, :1024]  # row stride
    w = torch.randn(555, 1000, device="cuda", dtype=torch.bfloat16) / 30
    w2 = torch.randn(555, 1024, device="cuda", dtype=torch.bfloat16) / 30
    b = torch.randn(555, device="cuda", dtype=torch.bfloat16)
    assert_close(skinny_linear(x, w, b), reference(x, w, b), torch.bfloat16)
    assert_close(skinny_linear(rows, w2), reference(rows, w2), torch.bfloat16)


@pytest.mark.parametrize("cfg", [None, *SPLIT_CONFIGS])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_skinny_linear_replays_in_a_cuda_graph(m: int, cfg: dict | None) -> None:
    from workers.model.skinny_gemm import MAX_GEMV_ROWS, Config, skinny_linear

    if cfg and not cfg.get("dot") and m > MAX_GEMV_ROWS:
        pytest.skip("the GEMV kernel takes few rows")
    config = Config(**cfg) if cfg else None
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64
    skinny_linear(x, w, config=config)  # compile outside the capture, as warm-up forwards do
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, config=config)
        y2 = skinny_linear(x, w, config=config)  # a second launch on the same locks
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, reference(x, w), torch.bfloat16)
        assert torch.equal(y, y2)


def test_layers_use_the_kernel_only_where_it_was_measured_to_win() -> None:
    from workers.model import skinny_gemm
    from workers.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    tp = TPGroup()
    qkv = ColumnParallelLinear(4096, [4096, 1024, 1024], bias=True, tp=tp)  # Llama-3-8B's
    o_proj = RowParallelLinear(4096, 4096, bias=False, tp=tp)
    head = ParallelLMHead(128256, 4096, tp)
    small = ColumnParallelLinear(512, [300], bias=False, tp=tp)  # not measured: F.linear
    for mod in (qkv, o_proj, head, small):
        mod.cuda().to(torch.bfloat16)
        torch.nn.init.normal_(mod.weight, std=0.02)
    torch.nn.init.normal_(qkv.bias)
    assert skinny_gemm.applies(1, qkv.weight) and not skinny_gemm.applies(16, qkv.weight)
    assert skinny_gemm.applies(64, head.weight) and not skinny_gemm.applies(65, head.weight)
    assert not skinny_gemm.applies(1, small.weight)
    for m in (1, 3, 16, 64, 300):  # 300 rows is prefill: F.linear
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        for out, w, b in [
            (qkv(x), qkv.weight, qkv.bias),
            (o_proj(x), o_proj.weight, None),
            (head.logits(x), head.weight, None),
        ]:
            assert_close(out, reference(x, w, b), torch.bfloat16)
            used = skinny_gemm.applies(m, w)
            expect = skinny_gemm.skinny_linear(x, w, b) if used else F.linear(x, w, b)
            assert torch.equal(out, expect), (m, tuple(w.shape), used)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(small(x), F.linear(x, small.weight))
