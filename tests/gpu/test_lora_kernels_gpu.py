"""The Triton LoRA kernels (`workers/kernels/lora_sgmv.py`) on a GPU in bf16 against the masked
dense products in float64 on the CPU, at Llama-3-8B's q/k/v and down shapes with 8 slots of rank
16, on normed rows and on a raw stream with its sums of squares (a folded norm)."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import reduction_atol
from workers.kernels.lora_ops import add_lora, add_lora_beside, lora_beside
from workers.kernels.lora_sgmv import MAX_TOKENS, sgmv_add_lora
from workers.kernels.skinny_tiles import SUMSQ_SLOTS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("tokens", [1, 16, MAX_TOKENS])
@pytest.mark.parametrize("n_in,out_parts", [(4096, [4096, 1024, 1024]), (14336, [4096])])
def test_sgmv_on_gpu(tokens: int, n_in: int, out_parts: list[int], normed: bool) -> None:
    """`normed`: x is a raw stream with its rows' float64 sums of squares (a folded norm)."""
    dtype, slots, rank, dev, eps = torch.bfloat16, 8, 16, "cuda", 1e-5
    gen = torch.Generator(device=dev).manual_seed(tokens)
    parts, out = len(out_parts), sum(out_parts)
    x = (torch.randn(tokens, n_in, generator=gen, device=dev) * (4 if normed else 1)).to(dtype)
    a = (torch.randn(slots, parts * rank, n_in, generator=gen, device=dev) / n_in**0.5).to(dtype)
    b = (torch.randn(out, slots, rank, generator=gen, device=dev) / rank**0.5).to(dtype)
    y = torch.randn(tokens, out, generator=gen, device=dev).to(dtype)
    mask = torch.zeros(tokens, slots, device=dev)
    token_slots = torch.arange(tokens, device=dev) % (slots + 1) - 1  # -1: a base token
    live = token_slots >= 0
    mask[live.nonzero().flatten(), token_slots[live]] = 1.0
    sumsq = x.double().square().view(tokens, SUMSQ_SLOTS, -1).sum(-1)
    x_ref = x.double() * torch.rsqrt(sumsq.sum(1, keepdim=True) / n_in + eps) if normed else x
    ref = [t.double().cpu() for t in (x_ref, y, a, b, mask)]  # the torch path, on the CPU
    want = add_lora(*ref[:1], ref[1].clone(), *ref[2:], out_parts)
    got = sgmv_add_lora(x, y.clone(), a, b, mask.to(dtype), out_parts,
                        *((sumsq, eps) if normed else ()))  # fmt: skip
    assert torch.equal(got[~live], y[~live])
    scale = float(add_lora(*(t.abs() for t in ref[:4]), ref[4], out_parts).max())
    atol = reduction_atol(n_in + rank, scale, dtype) + float(torch.finfo(dtype).eps) * scale
    assert float((got.double().cpu() - want).abs().max()) < atol


@pytest.mark.parametrize("tokens", [16, MAX_TOKENS + 8])  # the SGMV kernels, the masked path
def test_products_beside_the_base_gemm_in_a_graph(tokens: int) -> None:
    """`add_lora_beside` (the products on a second stream, then added) in a captured CUDA graph
    replayed on new inputs: the base GEMM plus `add_lora`'s products, but for the products'
    one more bf16 rounding before the add."""
    dtype, slots, rank, n_in, out, dev = torch.bfloat16, 4, 16, 2048, 3072, "cuda"
    gen = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.zeros(tokens, n_in, dtype=dtype, device=dev)
    w = (torch.randn(out, n_in, generator=gen, device=dev) / n_in**0.5).to(dtype)
    a = (torch.randn(slots, rank, n_in, generator=gen, device=dev) / n_in**0.5).to(dtype)
    b = (torch.randn(out, slots, rank, generator=gen, device=dev) / rank**0.5).to(dtype)
    mask = torch.zeros(tokens, slots, dtype=dtype, device=dev)
    mask[torch.arange(tokens, device=dev), torch.arange(tokens, device=dev) % slots] = 1.0
    mask[::5] = 0.0  # base tokens
    base = lambda: x @ w.t()  # noqa: E731
    add_lora_beside(base, x, a, b, mask, [out])  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = add_lora_beside(base, x, a, b, mask, [out])
    for seed in (1, 2):
        x.copy_(torch.randn(tokens, n_in, generator=gen.manual_seed(seed), device=dev))
        graph.replay()
        want = add_lora(x, base(), a, b, mask, [out])
        products = add_lora(x, torch.zeros_like(want), a, b, mask, [out])
        scale = float(want.abs().max()) + float(products.abs().max())
        assert float((got - want).abs().max()) <= 2 * float(torch.finfo(dtype).eps) * scale
        assert torch.equal(got[::5], base()[::5])  # base tokens: the GEMM alone


@pytest.mark.parametrize("finish", ["sums", "gated"])
def test_products_beside_then_the_sums_or_the_activation(finish: str) -> None:
    """The products beside a GEMM, finished in one launch: `add_lora_beside` with `sums_out`,
    after a residual GEMM that summed its rows' squares (o and down on the folded path), the
    sums redone for the rows with the products added; `lora_beside`'s two given to the
    activation (gate/up's `silu_and_mul(y, added)`)."""
    from workers.kernels import fused
    from workers.model.layers import residual_linear, silu_and_mul

    dtype, slots, rank, tokens, n_in, dev = torch.bfloat16, 4, 16, 16, 2048, "cuda"
    parts = [3072] if finish == "sums" else [1536, 1536]
    gen = torch.Generator(device=dev).manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=dev)  # noqa: E731
    x, residual = rand(tokens, n_in).to(dtype), rand(tokens, sum(parts)).to(dtype)
    w = (rand(sum(parts), n_in) / n_in**0.5).to(dtype)
    a = (rand(slots, len(parts) * rank, n_in) / n_in**0.5).to(dtype)
    b = (rand(sum(parts), slots, rank) / rank**0.5).to(dtype)
    mask = torch.zeros(tokens, slots, dtype=dtype, device=dev)
    mask[torch.arange(tokens, device=dev), torch.arange(tokens, device=dev) % slots] = 1.0
    products = add_lora(x, torch.zeros(tokens, sum(parts), dtype=dtype, device=dev), a, b,
                        mask, parts)  # fmt: skip
    sums = torch.zeros(tokens, SUMSQ_SLOTS, dtype=torch.float64, device=dev)
    if finish == "sums":
        base = lambda: residual_linear(x, w, residual, sums)  # noqa: E731
        got = add_lora_beside(base, x, a, b, mask, parts, sums_out=sums)
        want = residual_linear(x, w, residual, torch.zeros_like(sums)) + products
        torch.testing.assert_close(sums[:, 0], got.double().square().sum(1), rtol=1e-12, atol=0)
        assert not sums[:, 1:].any()
    else:
        got = silu_and_mul(*lora_beside(lambda: x @ w.t(), x, a, b, mask, parts))
        want = fused.silu_and_mul(x @ w.t() + products)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 4 * float(torch.finfo(dtype).eps) * scale


LLAMA_PROJECTIONS = [  # (input size, output parts, gated): q/k/v, gate/up, down
    (4096, [4096, 1024, 1024], False),
    (4096, [14336, 14336], True),
    (14336, [4096], False),
]


@pytest.mark.parametrize("tokens", [16, 40, MAX_TOKENS])  # the tensor-core kernel's rows
@pytest.mark.parametrize("n_in,out_parts,gated", LLAMA_PROJECTIONS)
def test_products_in_the_gemm_epilogue(
    tokens: int, n_in: int, out_parts: list[int], gated: bool
) -> None:
    """`skinny_linear(lora=...)` (the table's config for Llama-3-8B's q/k/v, gate/up and down)
    against the base GEMM plus the products in float64 (gated: then the activation)."""
    from workers.kernels import skinny_gemm
    from workers.kernels.lora_sgmv import shrunk_rows

    dtype, slots, rank, dev = torch.bfloat16, 8, 16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(tokens)
    out = sum(out_parts)
    x = torch.randn(tokens, n_in, generator=gen, device=dev).to(dtype)
    w = (torch.randn(out, n_in, generator=gen, device=dev) / n_in**0.5).to(dtype)
    a = (torch.randn(slots, len(out_parts) * rank, n_in, generator=gen, device=dev)
         / n_in**0.5).to(dtype)  # fmt: skip
    b = (torch.randn(out, slots, rank, generator=gen, device=dev) / rank**0.5).to(dtype)
    mask = torch.zeros(tokens, slots, dtype=dtype, device=dev)
    mask[torch.arange(tokens, device=dev), torch.arange(tokens, device=dev) % slots] = 1.0
    mask[::3] = 0.0  # base tokens
    if not skinny_gemm.applies(tokens, w, gated):
        pytest.skip("no skinny GEMM table cell for this GPU and shape: no epilogue to test")
    assert skinny_gemm.lora_fits(tokens, w, out_parts, gated)
    got = skinny_gemm.skinny_linear(x, w, gated=gated,
                                    lora=shrunk_rows(x, a, b, mask, out_parts))  # fmt: skip
    ref = [t.double().cpu() for t in (x, w, a, b, mask)]
    want = add_lora(ref[0], ref[0] @ ref[1].T, *ref[2:], out_parts)
    mags = add_lora(ref[0].abs(), ref[0].abs() @ ref[1].abs().T, *(t.abs() for t in ref[2:]),
                    out_parts)  # fmt: skip
    if gated:
        gate, up = (p.to(dtype).double() for p in want.chunk(2, -1))
        want, mags = torch.nn.functional.silu(gate) * up, mags[:, :14336] * mags[:, 14336:]
    atol = reduction_atol(n_in + rank, float(mags.max()), dtype) * (3 if gated else 1)
    assert float((got.double().cpu() - want).abs().max()) < atol
