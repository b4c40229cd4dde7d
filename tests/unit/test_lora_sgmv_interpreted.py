"""The Triton LoRA kernels (`workers/kernels/lora_sgmv.py`) in Triton's interpreter on the CPU,
against the masked dense products (`lora_ops.add_lora`'s torch path) in float64: a fused
projection of three uneven parts and a single one, tokens of every slot and base tokens, input
and output sizes that no block divides; and each of them on a raw stream with the float64 sums
of its rows' squares (a folded norm: the products of the RMS-normalised rows). In fp16 (the
interpreter's bf16 products are wrong). Also the kernels that add products made beside a GEMM
(`kernels.lora_products="beside"`): `fused.add_square_sums` (into a GEMM's output whose next
norm's sums of squares it redoes), `fused.silu_and_mul` given them (gate/up's activation of
the sum) and `rope.rotary_store` given them (q/k/v's, added before the norms and rotary)."""

from __future__ import annotations

import itertools

import torch

from tests.tolerance import reduction_atol
from tests.unit.test_skinny_gemm_interpreted import interpreted

CASES = [  # (tokens, slots, stack rank, input size, output parts)
    (7, 3, 8, 600, [40, 24, 24]),  # q/k/v; two input splits, the second partial
    (5, 2, 16, 96, [200]),  # o/down
    (3, 1, 4, 130, [70, 70]),  # gate/up, one slot
]


def check() -> None:
    """Each case against the torch path in float64; run with TRITON_INTERPRET=1."""
    from workers.kernels.lora_ops import add_lora
    from workers.kernels.lora_sgmv import sgmv_add_lora
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    dtype, eps = torch.float16, 1e-5
    gen = torch.Generator().manual_seed(0)
    for (tokens, slots, rank, n_in, out_parts), normed in itertools.product(CASES, (False, True)):
        out, parts = sum(out_parts), len(out_parts)
        x = (torch.randn(tokens, n_in, generator=gen) * (4.0 if normed else 1.0)).to(dtype)
        # the squares' sums as a GEMM epilogue leaves them: spread over the slots unevenly
        sumsq = x.double().square().view(tokens, -1, 1)
        sumsq = torch.cat([sumsq[:, i::SUMSQ_SLOTS].sum(1) for i in range(SUMSQ_SLOTS)], 1)
        x_ref = x.double() * torch.rsqrt(sumsq.sum(1, keepdim=True) / n_in + eps)
        norm_args = (sumsq, eps) if normed else ()
        a = (torch.randn(slots, parts * rank, n_in, generator=gen) / n_in**0.5).to(dtype)
        b = (torch.randn(out, slots, rank, generator=gen) / rank**0.5).to(dtype)
        token_slots = torch.arange(tokens) % (slots + 1) - 1  # -1: a base token
        mask = torch.zeros(tokens, slots)
        live = token_slots >= 0
        mask[live.nonzero().flatten(), token_slots[live]] = 1.0
        y = torch.randn(tokens, out, generator=gen).to(dtype)
        ref = (x_ref if normed else x.double(), y.double(), a.double(), b.double(), mask.double())
        want = add_lora(*ref[:1], ref[1].clone(), *ref[2:], out_parts)  # y: added into
        if normed:  # the torch path's own scaling, from the same sums
            raw = (x.double(), ref[1].clone(), *ref[2:])
            assert torch.allclose(add_lora(*raw, out_parts, sumsq, eps), want, rtol=1e-12)
        got = sgmv_add_lora(x, y.clone(), a, b, mask.to(dtype), out_parts, *norm_args)
        assert got.shape == y.shape and got.dtype == dtype
        assert torch.equal(got[~live], y[~live]), "base tokens' rows untouched"
        # float32 sums over the input, then over the rank, y rounded to fp16 once
        mags = [t.abs() for t in ref[:4]]  # (y's copy in `ref` is still y)
        scale = float(add_lora(*mags, mask.double(), out_parts).max())  # the terms' magnitudes
        atol = reduction_atol(n_in + rank, scale, dtype) + float(torch.finfo(dtype).eps) * scale
        err = float((got.double() - want).abs().max())
        assert err < atol, (tokens, slots, rank, n_in, out_parts, normed, err, atol)


def test_sgmv_equals_the_masked_products() -> None:
    interpreted("check", __name__)


def square_sums_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMM's output y `[5, 96]` (96: no power of 2), products x to add, and sums of squares
    as the GEMM left them (spread over the slots)."""
    from workers.kernels.skinny_tiles import SUMSQ_SLOTS

    gen = torch.Generator().manual_seed(1)
    y = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    x = (torch.randn(5, 96, generator=gen) * 0.1).to(dtype)
    return y, x, torch.rand(5, SUMSQ_SLOTS, generator=gen, dtype=torch.float64)


def check_square_sums() -> None:
    """The kernel (run with TRITON_INTERPRET=1) against the torch arithmetic: y + x rounded
    once, the new rows' sums of squares in float64 in the first slot, the others zero."""
    from workers.kernels import fused

    y, x, sumsq = square_sums_case(torch.float16)
    want = (y.float() + x.float()).to(y.dtype)
    kernel = fused._add_square_sums_kernel  # itself: `applies` is False on the CPU
    kernel[(5,)](y, x, sumsq, y.stride(0), x.stride(0), 96, SLOTS=sumsq.shape[1], BLOCK=128,
              PDL=False)  # fmt: skip
    assert torch.equal(y, want)
    assert torch.allclose(sumsq[:, 0], want.double().square().sum(1), rtol=1e-12)
    assert not sumsq[:, 1:].any()


def test_add_square_sums_kernel() -> None:
    interpreted("check_square_sums", __name__)


def test_add_square_sums_on_the_cpu() -> None:
    from workers.kernels import fused

    y, x, sumsq = square_sums_case(torch.bfloat16)
    want = y + x
    assert fused.add_square_sums(y, x, sumsq) is y and torch.equal(y, want)
    assert torch.equal(sumsq[:, 0], want.double().square().sum(1)) and not sumsq[:, 1:].any()


def check_silu_added() -> None:
    """`silu_and_mul(x, added)`'s kernel (TRITON_INTERPRET=1) against torch's add, then the
    activation as `fused.silu_and_mul` rounds it, and against the activation of x alone."""
    from workers.kernels import fused
    from workers.model.layers import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 700, generator=gen) * 3).to(torch.float16)  # 700: two blocks
    added = (torch.randn(3, 2 * 700, generator=gen) * 0.5).to(torch.float16)
    want, alone = (torch.empty(3, 700, dtype=torch.float16) for _ in range(2))
    kernel = fused._silu_and_mul_kernel  # itself: `applies` is False on the CPU
    for out, extra in ((want, added), (alone, None)):
        second = x if extra is None else extra
        kernel[(3, 2)](x, second, out, x.stride(0), 700, ADDED=extra is not None, BLOCK=512,
                       PDL=False)  # fmt: skip
    gate, up = (x + added).float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate).half().float() * up).half()
    # sigmoid's float32 may differ by an ulp from torch's, moving an fp16 rounding: one ulp
    one_ulp = dict(rtol=float(torch.finfo(torch.float16).eps), atol=1e-3)
    torch.testing.assert_close(want, ref, **one_ulp)
    assert (want - alone).abs().max() > 0.1  # the products were added
    torch.testing.assert_close(silu_and_mul(x, added), ref, **one_ulp)  # torch, off CUDA


def test_silu_and_mul_of_the_sum() -> None:
    interpreted("check_silu_added", __name__)


def check_rotary_store_added() -> None:
    """`rope.rotary_store(added=...)` (TRITON_INTERPRET=1), with and without Qwen3's q/k norms,
    against the same kernel given q, k and v with the products added by torch first: the same
    q and pool bytes; and far from the products left out."""
    from tests.unit.test_qk_norm_interpreted import DTYPE, EPS, cos_sin, qkv_rows
    from workers.kernels import rope
    from workers.kernels.norms import QKNorm

    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d = 5, 9, 3, 64
    q, k, v, wq, wk = qkv_rows(tokens, hq, hkv, d, gen)
    added = (torch.randn(tokens, hq + 2 * hkv, d, generator=gen) * 0.5).to(DTYPE)
    aq, ak, av = added.split([hq, hkv, hkv], dim=1)
    cos, sin = cos_sin(torch.arange(tokens) * 5 + 2, d)
    pages, slots = torch.tensor([1, 2, 2, 4, 3]), torch.tensor([0, 1, 3, 2, 0])
    for norm in (None, QKNorm(wq, wk, EPS)):
        pools = [torch.zeros(5, 2, 4, hkv, d, dtype=DTYPE) for _ in range(3)]
        got = rope.rotary_store(q, k, v, cos, sin, pools[0], pages, slots, qk_norm=norm,
                                added=added)  # fmt: skip
        want = rope.rotary_store(q + aq, k + ak, v + av, cos, sin, pools[1], pages, slots,
                                 qk_norm=norm)  # fmt: skip
        alone = rope.rotary_store(q, k, v, cos, sin, pools[2], pages, slots, qk_norm=norm)
        assert torch.equal(got, want) and torch.equal(pools[0], pools[1])
        assert (got - alone).abs().max() > 0.1
        for kv in (0, 1):  # k and v both take their products
            assert (pools[0][pages, kv, slots] - pools[2][pages, kv, slots]).abs().max() > 0.1


def test_rotary_store_adds_the_products() -> None:
    interpreted("check_rotary_store_added", __name__)


def check_attend_added() -> None:
    """`Attention.attend_added` (TRITON_INTERPRET=1) on a Qwen3 layer: the q/k/v rows and
    LoRA's products given to `RotaryStore.write` with the layer's q/k norms, then the backend's
    `attend_rotated` of the K/V it wrote, against `attend` of the rows with the products added
    by torch (the torch backend, which norms and rotates in torch): close, and far from
    `attend` of the rows alone."""
    from tests.unit.test_qk_norm_interpreted import DTYPE, EPS, cos_sin, rel_err
    from workers.attention.base import AttentionBatch
    from workers.attention.torch_ref import TorchAttention
    from workers.kernels import rope
    from workers.kvcache.pool import KVPool
    from workers.model.config import ModelConfig
    from workers.model.llama_attention import Attention
    from workers.parallel.group import SINGLE
    from workers.protocol import KVLayout

    hq, hkv, d, tokens = 4, 2, 32, 3
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=32,
        num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, rms_norm_eps=EPS,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False, qk_norm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    attention = Attention(cfg, 0, SINGLE)
    for p in attention.parameters():
        p.data.normal_(1.0, 0.3)
    attention.to(DTYPE)
    batch = AttentionBatch(q_lens=[tokens], kv_lens=[tokens], page_table=torch.tensor([[1]]),
                           slot_pages=torch.tensor([1, 1, 1]),
                           slot_offsets=torch.tensor([0, 1, 2]))  # fmt: skip

    class Written(TorchAttention):
        """The torch backend with `rotary_store`'s pair: it attends K/V already written."""

        def rotary_store(
            self, layer_id: int, cos: torch.Tensor, sin: torch.Tensor
        ) -> rope.RotaryStore:
            return rope.RotaryStore(cos, sin, self.pool.layer(layer_id), batch.slot_pages,
                                    batch.slot_offsets, 1.0, 1.0, hq)  # fmt: skip

        def attend_rotated(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
            kv = self.pool.layer(layer_id)[batch.slot_pages, :, batch.slot_offsets]
            return self.forward(layer_id, q.float(), kv[:, 0].float(), kv[:, 1].float())

    def backend(kind: type[TorchAttention]) -> TorchAttention:
        layout = KVLayout(num_layers=1, page_size=4, num_kv_heads=hkv, head_dim=d,
                          dtype="float16")  # fmt: skip
        attn = kind(KVPool(layout, 4, "cpu", DTYPE), hq, d**-0.5)
        attn.plan(batch)
        return attn

    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DTYPE)
    added = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DTYPE)
    cs = cos_sin(torch.arange(tokens) + 3, d)
    written = backend(Written)
    store = written.rotary_store(0, *cs)
    assert store is not None
    got = attention.attend_added(store, qkv, added, written)
    want = attention.attend(qkv + added, cs, backend(TorchAttention))
    alone = attention.attend(qkv, cs, backend(TorchAttention))
    assert got.shape == want.shape == (tokens, hq * d)
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    assert rel_err(got, alone) > 0.1


def test_attention_hands_the_products_to_the_rotary_kernel() -> None:
    interpreted("check_attend_added", __name__)
