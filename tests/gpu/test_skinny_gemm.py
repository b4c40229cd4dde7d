"""The Triton skinny GEMM equals x W^T (+ bias) to 16-bit rounding, and replays in CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.parallel.group import TPGroup

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
    [(4096, 4096), (6144, 4096), (100, 300), (1000, 1000), (333, 4104), (4096, 14336), (7, 64)]
    + [(3072, 4096), (4096, 2048), (4096, 7168)],  # shards at TP=2
)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 31, 32, 64])
def test_skinny_linear_matches_fp64_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    from workers.kernels.skinny_gemm import skinny_linear

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
    from workers.kernels.skinny_gemm import MAX_GEMV_ROWS, skinny_linear
    from workers.kernels.tuning import Config

    if not cfg.get("dot") and m > MAX_GEMV_ROWS:
        pytest.skip("the GEMV kernel takes few rows")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # the tile locks are back at zero after each launch
        assert_close(skinny_linear(x, w, b, Config(**cfg)), reference(x, w, b), torch.bfloat16)


def assert_float32_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A float32 result of 16-bit inputs: summed in fp32, so far inside one bf16 rounding."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("cfg", [None, dict(block_n=64, block_k=128, dot=True), *SPLIT_CONFIGS])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_float32_output_keeps_what_16_bit_rounding_drops(m: int, cfg: dict | None) -> None:
    """Logits: the fp32 sums of every kernel (GEMV, tensor-core, split-K) come out unrounded."""
    from workers.kernels.skinny_gemm import MAX_GEMV_ROWS, skinny_linear
    from workers.kernels.tuning import Config

    if cfg is not None and not cfg.get("dot") and m > MAX_GEMV_ROWS:
        pytest.skip("the GEMV kernel takes few rows")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(3000, 4096, device="cuda") / 64).to(torch.bfloat16)
    config = Config(**cfg) if cfg is not None else None
    assert_float32_close(
        skinny_linear(x, w, config=config, out_dtype=torch.float32), reference(x, w)
    )


@pytest.mark.parametrize("m", [1, 4, 24])
def test_skinny_linear_adds_bias_and_reads_strided_rows(m: int) -> None:
    from workers.kernels.skinny_gemm import skinny_linear

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
    from workers.kernels.skinny_gemm import MAX_GEMV_ROWS, skinny_linear
    from workers.kernels.tuning import Config

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


@pytest.mark.parametrize("dependent_launch", [True, False])
def test_layers_use_the_kernel_only_where_it_was_measured_to_win(
    dependent_launch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With PDL: every measured (shape, rows) cell, the gated product for gate_up where its
    config has no split-K; without: the cells that won on their own. Unmeasured shapes: F.linear."""
    from workers.kernels import fused, pdl, skinny_gemm
    from workers.model.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        silu_and_mul_linear,
    )

    if not dependent_launch:
        monkeypatch.setattr(pdl, "_supported", lambda device_index: False)
    elif not pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU has no programmatic dependent launch")
    tp = TPGroup()
    qkv = ColumnParallelLinear(4096, [4096, 1024, 1024], bias=True, tp=tp)  # Llama-3-8B's
    o_proj = RowParallelLinear(4096, 4096, bias=False, tp=tp)
    gate_up = ColumnParallelLinear(4096, [14336, 14336], bias=False, tp=tp)
    head = ParallelLMHead(128256, 4096, tp)
    small = ColumnParallelLinear(512, [300], bias=False, tp=tp)  # not measured: F.linear
    for mod in (qkv, o_proj, gate_up, head, small):
        mod.cuda().to(torch.bfloat16)
        torch.nn.init.normal_(mod.weight, std=0.02)
    torch.nn.init.normal_(qkv.bias)
    assert skinny_gemm.applies(1, qkv.weight)
    assert skinny_gemm.applies(16, qkv.weight) == dependent_launch
    assert skinny_gemm.applies(1, gate_up.weight, gated=True) == dependent_launch
    assert skinny_gemm.applies(16, gate_up.weight, gated=True) == dependent_launch  # a dot config
    assert skinny_gemm.applies(64, head.weight) and not skinny_gemm.applies(65, head.weight)
    assert not skinny_gemm.applies(1, small.weight)
    for m in (1, 3, 16, 64, 300):  # 300 rows is prefill: F.linear
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        logits = head.logits(x)  # float32, from either kernel
        assert_float32_close(logits, reference(x, head.weight))
        if skinny_gemm.applies(m, head.weight):
            expect = skinny_gemm.skinny_linear(x, head.weight, out_dtype=torch.float32)
        else:
            expect = torch.mm(x, head.weight.t(), out_dtype=torch.float32)
        assert torch.equal(logits, expect), m
        for out, w, b in [(qkv(x), qkv.weight, qkv.bias), (o_proj(x), o_proj.weight, None)]:
            assert_close(out, reference(x, w, b), torch.bfloat16)
            used = skinny_gemm.applies(m, w)
            expect = skinny_gemm.skinny_linear(x, w, b) if used else F.linear(x, w, b)
            assert torch.equal(out, expect), (m, tuple(w.shape), used)
        act = silu_and_mul_linear(x, gate_up.weight)
        if skinny_gemm.applies(m, gate_up.weight, gated=True):
            expect = skinny_gemm.skinny_linear(x, gate_up.weight, gated=True)
        else:
            expect = fused.silu_and_mul(
                skinny_gemm.skinny_linear(x, gate_up.weight)
                if skinny_gemm.applies(m, gate_up.weight)
                else F.linear(x, gate_up.weight)
            )
        assert torch.equal(act, expect), m
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(small(x), F.linear(x, small.weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(14336, 4096), (7168, 4096), (1536, 576), (100, 300), (7, 64)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gated_product_equals_the_gemm_then_silu_and_mul(
    m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    """One GEMV launch for [gate; up] gives silu(gate) * up rounded where the unfused path
    rounds (gate and up, then silu), and what the GEMM (same config) followed by
    `fused.silu_and_mul` gives, to 16-bit rounding (the fp32 sums may reduce in another order)."""
    from workers.kernels import fused
    from workers.kernels.skinny_gemm import config_for, skinny_linear

    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(2 * n, k, device="cuda") / k**0.5).to(dtype)
    cfg = config_for(1, 2 * n, k, x.device)  # a GEMV config
    out = skinny_linear(x, w, config=cfg, gated=True)
    assert out.shape == (m, n)
    gate, up = (part.to(dtype).double() for part in reference(x, w).chunk(2, dim=-1))
    assert_close(out, F.silu(gate).to(dtype).double() * up, dtype)
    assert_close(out, fused.silu_and_mul(skinny_linear(x, w, config=cfg)).double(), dtype)


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("n,k", [(14336, 4096), (1536, 576), (100, 300)])
@pytest.mark.parametrize("m", [2, 16, 33, 64])
def test_gated_product_on_tensor_cores(m: int, n: int, k: int, swap: bool) -> None:
    """The tensor-core kernel's gated launch (a tile of gate and one of up, half the config's
    block_n each) against the unfused path."""
    from workers.kernels import fused
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.tuning import Config

    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(2 * n, k, device="cuda") / k**0.5).to(dtype)
    cfg = Config(128, 128, num_stages=3, dot=True, swap=swap)
    out = skinny_linear(x, w, config=cfg, gated=True)
    gate, up = (part.to(dtype).double() for part in reference(x, w).chunk(2, dim=-1))
    assert_close(out, F.silu(gate).to(dtype).double() * up, dtype)
    assert_close(out, fused.silu_and_mul(skinny_linear(x, w, config=cfg)).double(), dtype)


def test_gated_product_refuses_what_it_cannot_do() -> None:
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.tuning import Config

    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    for cfg in (Config(16, 64, dot=True, split_k=2), Config(8, 64, split_k=2)):
        with pytest.raises(ValueError, match="gated"):
            skinny_linear(x, w, config=cfg, gated=True)
    with pytest.raises(ValueError, match="gated"):
        skinny_linear(x, w, torch.zeros(32, device="cuda", dtype=x.dtype), gated=True,
                      config=Config(16, 64, dot=True))  # fmt: skip


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()


NORM_CONFIGS = [
    dict(block_n=4, block_k=512),
    dict(block_n=8, block_k=256, split_k=4),
    dict(block_n=64, block_k=128, num_stages=4, dot=True, swap=True),
    dict(block_n=32, block_k=128, num_stages=4, dot=True, split_k=8),
]


@pytest.mark.parametrize("cfg", NORM_CONFIGS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (555, 1000)])
@pytest.mark.parametrize("m", [1, 3, 8, 33])
def test_residual_sums_of_squares_and_the_next_norm(m: int, n: int, k: int, cfg: dict) -> None:
    """`residual` + `sumsq_out`: y = residual + x W^T, and the slots of each row hold the sum of
    the squares of y's stored (rounded) values, exactly. `sumsq_in` (+ bias): the next launch
    multiplies y / rms(y) from those sums, as an RMSNorm with unit gain would."""
    from workers.kernels.skinny_gemm import MAX_GEMV_ROWS, skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS
    from workers.kernels.tuning import Config

    config = Config(**cfg)
    if not config.dot and m > MAX_GEMV_ROWS:
        pytest.skip("the GEMV kernel takes few rows")
    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    residual = (torch.randn(m, n, device="cuda") * 4 + 1).to(dtype)  # far from unit RMS
    sums = torch.zeros(m, SUMSQ_SLOTS, device="cuda", dtype=torch.float64)
    y = skinny_linear(x, w, config=config, residual=residual, sumsq_out=sums)
    assert_close(y, reference(x, w) + residual.double(), dtype)
    # In float64, up to the last bit (the values span more than 2^18: not all sums are exact).
    torch.testing.assert_close(sums.sum(-1), y.double().pow(2).sum(-1), rtol=1e-14, atol=0)
    assert torch.equal(skinny_linear(x, w, config=config, residual=residual), y)  # no sums
    w2 = (torch.randn(n // 2, n, device="cuda") / n**0.5).to(dtype)
    b = torch.randn(n // 2, device="cuda").to(dtype)
    normed = skinny_linear(y, w2, b, config=config, sumsq_in=sums, eps=1e-5)
    assert_close(normed, rms_normed(y, 1e-5) @ w2.double().T + b.double(), dtype)


@pytest.mark.parametrize("n,k", [(14336, 4096), (1536, 576)])
@pytest.mark.parametrize("m", [1, 5])
def test_gated_product_of_the_normed_input(m: int, n: int, k: int) -> None:
    from workers.kernels.skinny_gemm import config_for, skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    dtype = torch.bfloat16
    x = (torch.randn(m, k, device="cuda") * 5).to(dtype)
    sums = torch.zeros(m, SUMSQ_SLOTS, device="cuda", dtype=torch.float64)
    sums[:, 3] = x.double().pow(2).sum(-1)
    w = (torch.randn(2 * n, k, device="cuda") / k**0.5).to(dtype)
    cfg = config_for(1, 2 * n, k, x.device)  # a GEMV config
    out = skinny_linear(x, w, config=cfg, gated=True, sumsq_in=sums, eps=1e-6)
    gate, up = (part.to(dtype) for part in (rms_normed(x, 1e-6) @ w.double().T).chunk(2, -1))
    assert_close(out, F.silu(gate.double()).to(dtype).double() * up.double(), dtype)


def test_sums_and_residual_of_the_wrong_shape_are_refused() -> None:
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sumsq_in must be float64"):
        skinny_linear(x, w, sumsq_in=torch.zeros(2, SUMSQ_SLOTS, device="cuda"))
    with pytest.raises(ValueError, match="sumsq_out must be float64"):
        skinny_linear(x, w, sumsq_out=torch.zeros(1, SUMSQ_SLOTS, device="cuda").double())
    with pytest.raises(ValueError, match="residual must be"):
        skinny_linear(x, w, residual=torch.zeros(2, 32, device="cuda", dtype=torch.bfloat16))


def _decoder_chain(
    x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor, folded: bool
) -> torch.Tensor:
    """A decode layer's kernel sequence, each reading the one before: norm, GEMV, gated GEMV;
    `folded`: no norm kernel, the GEMVs normalise their input from the sums of squares that the
    one before left, and add the residual."""
    from workers.kernels import fused
    from workers.kernels.skinny_gemm import skinny_linear
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    residual = x
    if folded:
        sums = torch.zeros(len(weights) // 2 + 1, 1, SUMSQ_SLOTS, device="cuda").double()
        sums[0, :, 0] = x.double().pow(2).sum(-1)
        for i, (up, down) in enumerate(zip(weights[::2], weights[1::2], strict=True)):
            act = skinny_linear(residual, up, gated=True, sumsq_in=sums[i], eps=1e-5)
            residual = skinny_linear(act, down, residual=residual, sumsq_out=sums[i + 1])
        return residual
    for up, down in zip(weights[::2], weights[1::2], strict=True):
        h, residual = fused.add_rms_norm(x, residual, norm, 1e-5)
        x = skinny_linear(skinny_linear(h, up, gated=True), down)
    return x + residual


@pytest.mark.parametrize("folded", [False, True])
def test_dependent_launches_give_the_serial_results(
    folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With programmatic dependent launch each kernel starts during its predecessor and reads
    weights early: a chain of 24-36 of them, captured and replayed on fresh inputs, must equal
    the same chain launched without it, bit for bit (a read before `gdc_wait` would see stale
    x, a residual or sums of squares not yet written)."""
    from workers.kernels import pdl

    hidden, inter = 4096, 14336
    torch.manual_seed(0)
    weights = []
    for _ in range(12):
        weights.append((torch.randn(2 * inter, hidden, device="cuda") / 64).to(torch.bfloat16))
        weights.append((torch.randn(hidden, inter, device="cuda") / 120).to(torch.bfloat16))
    norm = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    assert pdl.launch_options(x)["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    _decoder_chain(x, weights, norm, folded)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decoder_chain(x, weights, norm, folded)
    inputs = [torch.randn_like(x) for _ in range(5)]
    replayed = []
    for value in inputs:
        x.copy_(value)
        graph.replay()
        replayed.append(out.clone())
    monkeypatch.setattr(pdl, "_supported", lambda device_index: False)
    for value, got in zip(inputs, replayed, strict=True):
        assert torch.equal(got, _decoder_chain(value, weights, norm, folded))


ROTARY_CONFIGS = [None, dict(block_n=128, block_k=128, num_stages=3, dot=True, swap=True),
                  dict(block_n=32, block_k=64, num_stages=4, dot=True)]  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("cfg", ROTARY_CONFIGS)
@pytest.mark.parametrize("m", [16, 33, 64])
def test_rotary_epilogue_equals_the_gemm_then_rotary_store(
    m: int, cfg: dict | None, kv_dtype: torch.dtype
) -> None:
    """Llama-3-8B's q/k/v (6144 x 4096, heads of 128) with a bias and an input norm: the launch
    that rotates and writes K/V in its epilogue gives the q and the pool bytes of the same
    GEMM's q/k/v then `rope.rotary_store`, bit for bit, the table's config (None) included;
    no other slot is written."""
    from workers.attention.rotary import RotaryEmbedding
    from workers.kernels import rope, skinny_gemm
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS
    from workers.kernels.tuning import Config

    hq, hkv, dim, pages, page_size = 32, 8, 128, 40, 16
    config = Config(**cfg) if cfg else None
    w = (torch.randn((hq + 2 * hkv) * dim, 4096, device="cuda") / 64).to(torch.bfloat16)
    bias = torch.randn(w.shape[0], device="cuda").to(torch.bfloat16)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    sums = torch.zeros(m, SUMSQ_SLOTS, dtype=torch.float64, device="cuda")
    sums[:, 3] = x.double().square().sum(-1)
    if config is None:
        assert skinny_gemm.rotary_applies(m, w, dim)
    positions = torch.randint(0, 8000, (m,), device="cuda")
    cos, sin = RotaryEmbedding(dim, 500000.0, None).cuda().cos_sin(positions, torch.bfloat16)
    slots = torch.randperm(pages * page_size, device="cuda")[:m]
    slot_pages, slot_offsets = slots // page_size, slots % page_size
    pool = torch.randn(pages, 2, page_size, hkv, dim, device="cuda").to(kv_dtype)
    expect_pool = pool.clone()
    store = rope.RotaryStore(cos, sin, pool, slot_pages, slot_offsets, 0.03, 0.02, hq)
    q = skinny_gemm.skinny_linear(x, w, bias, config, sumsq_in=sums, eps=1e-5, rotary=store)
    qkv = skinny_gemm.skinny_linear(x, w, bias, config, sumsq_in=sums, eps=1e-5)
    parts = qkv.split([hq * dim, hkv * dim, hkv * dim], -1)
    q_ref, k_ref, v_ref = (p.view(m, -1, dim) for p in parts)
    expect = rope.rotary_store(q_ref, k_ref, v_ref, cos, sin, expect_pool, slot_pages,
                               slot_offsets, 0.03, 0.02)  # fmt: skip
    assert torch.equal(q.view(m, hq, dim), expect)
    assert torch.equal(pool.view(torch.uint8), expect_pool.view(torch.uint8))


def test_rotary_epilogue_refuses_what_it_cannot_do() -> None:
    """No split-K, no tile across two heads, no other epilogue, a weight of the store's heads."""
    from workers.kernels import rope, skinny_gemm
    from workers.kernels.tuning import Config

    w = torch.randn(6 * 64, 256, device="cuda").to(torch.bfloat16)
    x = torch.randn(16, 256, device="cuda").to(torch.bfloat16)
    cos = torch.ones(16, 1, 64, device="cuda", dtype=torch.bfloat16)
    pool = torch.zeros(4, 2, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(16, device="cuda")
    store = rope.RotaryStore(cos, cos, pool, slots // 16, slots % 16, 1.0, 1.0, 4)
    good = Config(block_n=32, block_k=64, dot=True)
    skinny_gemm.skinny_linear(x, w, config=good, rotary=store)
    for cfg, kwargs in [
        (Config(block_n=32, block_k=64, dot=True, split_k=2), {}),
        (Config(block_n=128, block_k=64, dot=True), {}),
        (Config(block_n=8, block_k=64), {}),  # the GEMV kernel
        (good, dict(out_dtype=torch.float32)),
        (good, dict(residual=torch.zeros(16, 6 * 64, device="cuda", dtype=torch.bfloat16))),
    ]:
        with pytest.raises(ValueError, match="rotary epilogue"):
            skinny_gemm.skinny_linear(x, w, config=cfg, rotary=store, **kwargs)
    with pytest.raises(ValueError, match="does not match"):
        skinny_gemm.skinny_linear(x, w[:320], config=good, rotary=store)


@pytest.mark.parametrize("m", [1, 2, 16, 33, 64])
def test_blocked_gate_up_gives_the_row_major_bits(m: int) -> None:
    """Llama-3-8B's gate_up in blocks of 128 rows (`weight_blocks`), each M's table config (at
    M = 1 the M = 2 one: a blocked weight never runs the GEMV): the same bits as the same config
    over the row-major weight, gated or not; and `blocked_linear` (prefill) equals F.linear."""
    from workers.kernels import skinny_gemm
    from workers.kernels.weight_blocks import block_rows, blocked_linear

    gen = torch.Generator(device="cuda").manual_seed(m)
    w = (torch.randn(28672, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    x = torch.randn(m, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    blocked = w.clone()
    block_rows(blocked)
    cfg = skinny_gemm.config_for(max(m, 2), 28672, 4096, x.device)
    for gated in (False, True):
        expect = skinny_gemm.skinny_linear(x, w, config=cfg, gated=gated)
        assert torch.equal(skinny_gemm.skinny_linear(x, blocked, gated=gated), expect), gated
    torch.testing.assert_close(blocked_linear(x, blocked), F.linear(x, w))
