"""The Triton kernels equal the torch code they replace, to bf16/fp16 rounding. Qwen3's q/k
norms in the rotary kernels: here (`rope.rotary_store`, and the helpers the int8 and decode
kernels' tests in test_int8_kv_gpu.py and test_flashinfer_attention.py share)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.attention.rotary import RotaryEmbedding
from workers.kernels.norms import QKNorm
from workers.model.layers import RMSNorm

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (300, 576), (7, 9, 64)])
def test_rms_norm_matches_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from workers.kernels import fused

    x = torch.randn(shape, device="cuda").to(dtype) * 3
    weight = torch.randn(shape[-1], device="cuda").to(dtype)
    x32 = x.float()
    ref = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    close(fused.rms_norm(x, weight, 1e-5), ref)
    norm = RMSNorm(shape[-1], 1e-5).cuda().to(dtype)
    norm.weight.data.copy_(weight)
    close(norm(x), ref)  # the module dispatches to the kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (9, 64), (8, 128)])
def test_rotary_matches_torch(dtype: torch.dtype, heads: int, head_dim: int) -> None:
    from workers.kernels import rope

    tokens = 37
    packed = torch.randn(tokens, (heads + 2) * head_dim, device="cuda").to(dtype)
    x = packed[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided, like q after split
    positions = torch.randint(0, 8000, (tokens,), device="cuda")
    cos, sin = RotaryEmbedding(head_dim, 500000.0, None).cuda().cos_sin(positions, dtype)
    half = head_dim // 2
    ref = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    close(rope.rotary(x, cos, sin), ref)


LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,scaling", [(128, LLAMA3_SCALING), (64, None), (96, None)])
def test_cos_sin_kernel_matches_the_float32_torch_form(
    dtype: torch.dtype, head_dim: int, scaling: dict | None
) -> None:
    """One kernel for rotary's cos and sin: HF's float32 arithmetic, then one rounding, so at
    most one 16-bit step from torch's (their float32 cos may differ in the last bit)."""
    rope = RotaryEmbedding(head_dim, 500000.0, scaling).cuda()
    positions = torch.cat([torch.arange(0, 40), torch.randint(0, 131072, (300,))]).cuda()
    cos, sin = rope.cos_sin(positions, dtype)  # dispatches to the kernel
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    step = 2**-8 if dtype == torch.bfloat16 else 2**-11
    for got, ref in ((cos, emb.cos()), (sin, emb.sin())):
        assert got.shape == (340, 1, head_dim) and got.dtype == dtype
        torch.testing.assert_close(got.float(), ref.to(dtype).float(), rtol=0, atol=step)
        assert (got == ref.to(dtype)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 28672), (513, 3072)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    from workers.kernels import fused

    x = torch.randn(rows, width * 2, device="cuda").to(dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    close(fused.silu_and_mul(x), F.silu(gate) * up)
    added = torch.randn_like(x) * 0.5
    gate, up = (x + added).chunk(2, dim=-1)
    close(fused.silu_and_mul(x, added), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(16, 4096), (9, 576)])
def test_add_square_sums_adds_and_redoes_sums(dtype: torch.dtype, rows: int, width: int) -> None:
    from workers.kernels import fused
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    y = torch.randn(rows, width, device="cuda").to(dtype) * 3
    x = torch.randn(rows, width, device="cuda").to(dtype) * 0.1
    sumsq = torch.rand(rows, SUMSQ_SLOTS, device="cuda", dtype=torch.float64)
    want = y + x  # torch's add: one rounding
    assert fused.add_square_sums(y, x, sumsq) is y and torch.equal(y, want)
    torch.testing.assert_close(sumsq[:, 0], want.double().square().sum(1), rtol=1e-12, atol=0)
    assert not sumsq[:, 1:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 4096), (300, 576)])
def test_add_rms_norm_matches_add_then_norm(dtype: torch.dtype, rows: int, width: int) -> None:
    from workers.kernels import fused

    x = torch.randn(rows, width, device="cuda").to(dtype) * 3
    residual = torch.randn(rows, width, device="cuda").to(dtype) * 3
    weight = torch.randn(width, device="cuda").to(dtype)
    out, total = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)  # the same rounding as torch's add
    close(out, fused.rms_norm(residual + x, weight, 1e-5))
    norm = RMSNorm(width, 1e-5).cuda().to(dtype)
    norm.weight.data.copy_(weight)
    out2, total2 = norm.add_forward(x, residual)  # the module dispatches to the kernel
    assert torch.equal(out2, out) and torch.equal(total2, total)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_rotary_store_rotates_and_writes_slots(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Equal to `rope.rotary` of q and k plus an indexed write of k and v into the pool."""
    from workers.kernels import rope

    tokens, pages, page_size, layers = 37, 11, 4, 3
    packed = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q, k, v = packed.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8000, (tokens,), device="cuda")
    cos, sin = RotaryEmbedding(head_dim, 500000.0, None).cuda().cos_sin(positions, dtype)
    slots = torch.randperm(pages * page_size, device="cuda")[:tokens]
    slot_pages, slot_offsets = slots // page_size, slots % page_size
    pool = torch.randn(pages, layers, 2, page_size, kv_heads, head_dim, device="cuda").to(dtype)
    before = pool.clone()
    layer = 1
    q_out = rope.rotary_store(q, k, v, cos, sin, pool[:, layer], slot_pages, slot_offsets)
    close(q_out, rope.rotary(q, cos, sin))
    close(pool[slot_pages, layer, 0, slot_offsets], rope.rotary(k, cos, sin))
    assert torch.equal(pool[slot_pages, layer, 1, slot_offsets], v)
    pool[slot_pages, layer, :, slot_offsets] = before[slot_pages, layer, :, slot_offsets]
    assert torch.equal(pool, before)  # no slot but the tokens' own was written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_adds_the_products_as_an_add_before_it(dtype: torch.dtype) -> None:
    """`rotary_store(added=...)` (LoRA's q/k/v products, `lora_products="beside"`): the same q
    and pool bytes as the products added by torch first, then the kernel; not those without."""
    from workers.kernels import rope

    tokens, heads, kv_heads, head_dim, pages, page_size = 21, 32, 8, 128, 9, 4
    width = (heads + 2 * kv_heads) * head_dim
    packed = torch.randn(tokens, width, device="cuda").to(dtype)
    added = (torch.randn(tokens, width, device="cuda") * 0.3).to(dtype)
    split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    shapes = [(tokens, heads, head_dim), (tokens, kv_heads, head_dim), (tokens, kv_heads, head_dim)]
    qkv = [x.view(s) for x, s in zip(packed.split(split, dim=-1), shapes)]
    summed = [x.view(s) for x, s in zip((packed + added).split(split, dim=-1), shapes)]
    positions = torch.randint(0, 8000, (tokens,), device="cuda")
    cos, sin = RotaryEmbedding(head_dim, 500000.0, None).cuda().cos_sin(positions, dtype)
    slots = torch.randperm(pages * page_size, device="cuda")[:tokens]
    pools = [torch.zeros(pages, 2, page_size, kv_heads, head_dim, device="cuda", dtype=dtype)
             for _ in range(3)]  # fmt: skip
    where = (slots // page_size, slots % page_size)
    got = rope.rotary_store(*qkv, cos, sin, pools[0], *where,
                            added=added.view(tokens, -1, head_dim))  # fmt: skip
    want = rope.rotary_store(*summed, cos, sin, pools[1], *where)
    alone = rope.rotary_store(*qkv, cos, sin, pools[2], *where)
    assert torch.equal(got, want) and torch.equal(pools[0], pools[1])
    assert not torch.equal(got, alone) and not torch.equal(pools[0], pools[2])


QK_EPS = 1e-6


def strided_qkv(
    tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q `[T, hq, d]`, k and v `[T, hkv, d]` as views of one packed q/k/v output (strided, as
    `Attention.attend` splits it), heads of very different magnitudes (the norm's reason)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    packed = torch.randn(tokens, hq + 2 * hkv, d, generator=gen, device="cuda")
    scales = torch.rand(tokens, hq + 2 * hkv, 1, generator=gen, device="cuda") * 20 + 0.01
    q, k, v = (packed * scales).to(dtype).split([hq, hkv, hkv], dim=1)
    return q, k, v


def qk_norm_weights(head_dim: int, dtype: torch.dtype) -> QKNorm:
    """Random q and k norm weights around 1: a row's two halves get different weights, so a
    norm after the rotary (which mixes them) would not give the same values."""
    gen = torch.Generator("cuda").manual_seed(head_dim)
    w = (torch.randn(2, head_dim, generator=gen, device="cuda") * 0.5 + 1).to(dtype)
    return QKNorm(w[0], w[1], QK_EPS)


def unfused_orders(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`rope.rotary(fused.rms_norm(x))`, the unfused path's q or k, and what a kernel that
    dropped the norm or applied it after the rotary would give instead."""
    from workers.kernels import fused, rope

    turned = rope.rotary(x, cos, sin)
    wrong = [turned, fused.rms_norm(turned, w, QK_EPS)]
    return rope.rotary(fused.rms_norm(x, w, QK_EPS), cos, sin), wrong


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but where the sum of squares' order, or the compiler's contractions, move a
    rounding by a step (a few values in a hundred at most)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)
    assert float((got != want).float().mean()) < 0.02


def assert_far_from(got: torch.Tensor, wrong: list[torch.Tensor]) -> None:
    for bad in wrong:
        rel = float((got.float() - bad.float()).norm() / bad.float().norm())
        assert rel > 0.1, rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (9, 64)])
def test_rms_norm_reads_strided_heads_in_place(
    dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    """The unfused q/k norm (`QKNorm.apply`): heads of a packed q/k/v output, read where they
    are, give their contiguous copy's result bit for bit, and the torch form's."""
    from workers.kernels import fused

    packed = (torch.randn(37, heads + 6, head_dim, device="cuda") * 3).to(dtype)
    x = packed[:, 2 : 2 + heads]
    weight = torch.randn(head_dim, device="cuda").to(dtype)
    out = fused.rms_norm(x, weight, QK_EPS)
    assert out.is_contiguous() and torch.equal(out, fused.rms_norm(x.contiguous(), weight, QK_EPS))
    x32 = x.float()
    close(out, weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + QK_EPS)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 4, 128), (9, 3, 64)])
def test_rotary_store_applies_the_qk_norms_first(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """With `qk_norm` (Qwen3) the returned q and the written k are the unfused path's
    (`fused.rms_norm`, then `rope.rotary`), far from the norm dropped or applied after the
    rotary; v is written as it is, and no other slot."""
    from workers.kernels import rope

    tokens, pages, page_size = 37, 11, 4
    q, k, v = strided_qkv(tokens, heads, kv_heads, head_dim, dtype, seed=head_dim + heads)
    norm = qk_norm_weights(head_dim, dtype)
    positions = torch.randint(1, 8000, (tokens,), device="cuda")
    cos, sin = RotaryEmbedding(head_dim, 1000000.0, None).cuda().cos_sin(positions, dtype)
    slots = torch.randperm(pages * page_size, device="cuda")[:tokens]
    slot_pages, slot_offsets = slots // page_size, slots % page_size
    pool = torch.randn(pages, 2, page_size, kv_heads, head_dim, device="cuda").to(dtype)
    before = pool.clone()
    q_out = rope.rotary_store(q, k, v, cos, sin, pool, slot_pages, slot_offsets, qk_norm=norm)
    written = pool[slot_pages, 0, slot_offsets]
    for got, x, w in ((q_out, q, norm.q_weight), (written, k, norm.k_weight)):
        want, wrong = unfused_orders(x, w, cos, sin)
        assert_rounded_alike(got, want)
        assert_far_from(got, wrong)
    assert torch.equal(pool[slot_pages, 1, slot_offsets], v)
    pool[slot_pages, :, slot_offsets] = before[slot_pages, :, slot_offsets]
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 4096), (3, 576), (8, 100)])
def test_step_inputs_gather_rows_their_exact_sums_of_squares_and_cos_sin(
    dtype: torch.dtype, rows: int, dim: int
) -> None:
    """The rows of `F.embedding`, bit for bit; entry 0 holds each row's float64 sum of squares
    (exact: squares of 16-bit values) in its first slot, every other slot and entry zero; cos
    and sin as the `cos_sin` kernel gives them."""
    from workers.kernels.rope import cos_sin
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS
    from workers.kernels.step_inputs import step_inputs

    weight = (torch.randn(1000, dim, device="cuda") * 8).to(dtype)
    ids = torch.randint(0, 1000, (rows,), device="cuda")
    positions = torch.randint(0, 100_000, (rows,), device="cuda")
    inv_freq = RotaryEmbedding(64, 500000.0, None).inv_freq.cuda()
    x, sums, (cos, sin) = step_inputs(ids, positions, weight, inv_freq, num_sums=5)
    assert torch.equal(x, F.embedding(ids, weight))
    assert sums.shape == (5, rows, SUMSQ_SLOTS) and sums.dtype == torch.float64
    torch.testing.assert_close(sums[0, :, 0], x.double().pow(2).sum(-1), rtol=1e-15, atol=0)
    assert not sums[0, :, 1:].any() and not sums[1:].any()
    ref_cos, ref_sin = cos_sin(positions, inv_freq, dtype)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
