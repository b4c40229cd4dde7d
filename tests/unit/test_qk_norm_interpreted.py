"""Qwen3's per-head q/k RMSNorms inside the rotary kernels, in Triton's interpreter on the CPU:
`rope.rotary_store`, `rope_int8.rotary_store_int8` (both q paths) and the batch-1 decode kernel
`SplitKVDecode` with `qk_norm` against the norm (`layers.rms_norm`, torch arithmetic) then the
rotary embedding; `fused.rms_norm` reading strided q/k heads in place; and the model's
`Attention.attend` handing the norms to a backend's `forward_rotary`. Each kernel check also
asserts its result is far from the norm dropped or applied after the rotation (the weights are
random, so a norm after the rotary differs). In fp16 (the interpreter rounds to bf16 by
truncation, and its bf16 tensor-core products are wrong); the GPU tests, in bf16, are in
tests/gpu/test_fused_kernels.py, test_int8_kv_gpu.py and test_flashinfer_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_skinny_gemm_interpreted import interpreted
from workers.attention.base import AttentionBatch
from workers.attention.rotary import RotaryEmbedding, apply_rotary
from workers.attention.torch_ref import TorchAttention
from workers.kernels.norms import QKNorm, rms_norm
from workers.kvcache.int8_rows import hadamard, quantize_rows
from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout

pytest.importorskip("triton")

HEADS = [(9, 3, 64), (32, 4, 128)]  # SmolLM2-like (a group of 3), and a group of 8 at d 128
EPS = 1e-6
DTYPE = torch.float16


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernels' rotary: float32 arithmetic, one rounding to x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos.float() + turned * sin.float()).to(x.dtype)


def normed_then_rotated(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return rotated(rms_norm(x, w, EPS), cos, sin)


def wrong_orders(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> list[torch.Tensor]:
    """What a kernel that dropped the norm, or applied it after the rotary, would give."""
    return [rotated(x, cos, sin), rms_norm(rotated(x, cos, sin), w, EPS)]


def assert_equal_but_rarely(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the order of the sum of squares, which may move a rounding by a step."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    assert float((got != want).float().mean()) < 0.01


def assert_far(got: torch.Tensor, wrong: list[torch.Tensor]) -> None:
    for bad in wrong:
        rel = float((got.float() - bad.float()).norm() / bad.float().norm())
        assert rel > 0.1, rel


def qkv_rows(
    tokens: int, hq: int, hkv: int, d: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Strided q, k and v views of one packed q/k/v output (as `Attention.attend` splits it),
    heads of very different magnitudes (the norm's reason), and random norm weights."""
    packed = torch.randn(tokens, hq + 2 * hkv, d, generator=gen)
    packed *= torch.tensor([0.01, 1.0, 30.0])[torch.randint(3, (tokens, hq + 2 * hkv, 1),
                                                            generator=gen)]  # fmt: skip
    packed = packed.to(DTYPE).view(tokens, -1)
    q, k, v = packed.split([hq * d, hkv * d, hkv * d], dim=-1)
    weights = [(torch.randn(d, generator=gen) * 0.5 + 1).to(DTYPE) for _ in range(2)]
    return (q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d), *weights)


def cos_sin(
    positions: torch.Tensor, d: int, dtype: torch.dtype = DTYPE
) -> tuple[torch.Tensor, ...]:
    return RotaryEmbedding(d, 1000000.0, None).cos_sin(positions, dtype)


def check_rotary_store() -> None:
    """`rope.rotary_store` with and without the norms: q returned, k and v in their slots and
    no other slot written; run with TRITON_INTERPRET=1."""
    from workers.kernels import rope

    gen = torch.Generator().manual_seed(0)
    for hq, hkv, d in HEADS:
        tokens = 6
        q, k, v, wq, wk = qkv_rows(tokens, hq, hkv, d, gen)
        cos, sin = cos_sin(torch.arange(tokens) * 11 + 5, d)
        pages, slots = torch.tensor([1, 2, 2, 5, 3, 4]), torch.tensor([0, 1, 3, 2, 0, 3])
        for norm in (QKNorm(wq, wk, EPS), None):
            kv = torch.randn(6, 2, 4, hkv, d, generator=gen).to(DTYPE)
            before = kv.clone()
            out = rope.rotary_store(q, k, v, cos, sin, kv, pages, slots, qk_norm=norm)
            if norm is None:  # as before the norms: exactly the rotary
                assert torch.equal(out, rotated(q, cos, sin))
                assert torch.equal(kv[pages, 0, slots], rotated(k, cos, sin))
            else:
                assert_equal_but_rarely(out, normed_then_rotated(q, wq, cos, sin))
                assert_far(out, wrong_orders(q, wq, cos, sin))
                written = kv[pages, 0, slots]
                assert_equal_but_rarely(written, normed_then_rotated(k, wk, cos, sin))
                assert_far(written, wrong_orders(k, wk, cos, sin))
            assert torch.equal(kv[pages, 1, slots], v)
            kv[pages, :, slots] = before[pages, :, slots]
            assert torch.equal(kv, before)


def check_rotary_store_int8() -> None:
    """`rope_int8.rotary_store_int8` with the norms, both q paths: q (rotated, or times H in
    float32) and the int8 rows of k against `quantize_rows` of the normed, rotated k."""
    from workers.kernels import rope_int8

    gen = torch.Generator().manual_seed(1)
    for hq, hkv, d in HEADS:
        tokens = 5
        q, k, v, wq, wk = qkv_rows(tokens, hq, hkv, d, gen)
        cos, sin = cos_sin(torch.arange(tokens) * 7 + 3, d)
        pages, slots = torch.tensor([1, 2, 2, 5, 3]), torch.tensor([0, 1, 3, 2, 0])
        half, h = hadamard(d // 2, torch.device("cpu")), hadamard(d, torch.device("cpu"))
        assert half is not None and h is not None
        norm = QKNorm(wq, wk, EPS)
        want_q = normed_then_rotated(q, wq, cos, sin)
        want_k = normed_then_rotated(k, wk, cos, sin)
        for by_h in (False, True):
            kv = torch.zeros(6, 3, 2, 4, hkv, d + 4, dtype=torch.int8)[:, 1]  # a layer's view
            out = rope_int8.rotary_store_int8(q, k, v, cos, sin, kv, half, pages, slots,
                                              rotate_q_by_h=by_h, qk_norm=norm)  # fmt: skip
            if by_h:
                assert out.dtype == torch.float32
                torch.testing.assert_close(out, want_q.float() @ h, rtol=2e-3, atol=1e-2)
                assert_far(out, [bad.float() @ h for bad in wrong_orders(q, wq, cos, sin)])
            else:
                assert_equal_but_rarely(out, want_q)
                assert_far(out, wrong_orders(q, wq, cos, sin))
            for kv_index, x in ((0, want_k), (1, v)):
                got, want = kv[pages, kv_index, slots], quantize_rows(x)
                # the Hadamard products' order of sums may move a value by a step
                assert int((got[..., :d].int() - want[..., :d].int()).abs().max()) <= 1
                assert float((got[..., :d] != want[..., :d]).float().mean()) < 0.01
                scales = [r[..., d:].contiguous().view(torch.float32) for r in (got, want)]
                torch.testing.assert_close(*scales, rtol=2e-3, atol=0)
            for bad in wrong_orders(k, wk, cos, sin):  # an int8 row is its own scale's
                wrong = quantize_rows(bad)[..., :d].float()
                assert float((kv[pages, 0, slots][..., :d].float() - wrong).abs().mean()) > 5


PAGE = 16


def decode_case(hq: int, hkv: int, d: int, length: int, seed: int) -> tuple[KVPool, ...]:
    """An fp16 pool of random K/V (two layers) and one sequence of `length` tokens on shuffled
    pages (its new token's slot the last), with its page table in FlashInfer's CSR form."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-length // PAGE)
    layout = KVLayout(num_layers=2, page_size=PAGE, num_kv_heads=hkv, head_dim=d,
                      dtype="float16")  # fmt: skip
    pool = KVPool(layout, pages + 3, "cpu", DTYPE)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(DTYPE))
    owned = (torch.randperm(pool.num_pages - 1, generator=gen) + 1).int()[:pages]
    batch = AttentionBatch(
        q_lens=[1], kv_lens=[length], page_table=owned[None, :],
        slot_pages=owned[(length - 1) // PAGE : (length - 1) // PAGE + 1].long(),
        slot_offsets=torch.tensor([(length - 1) % PAGE]),
    )  # fmt: skip
    csr = (torch.tensor([0, pages], dtype=torch.int32), owned,
           torch.tensor([length - (pages - 1) * PAGE], dtype=torch.int32))  # fmt: skip
    return pool, batch, csr  # type: ignore[return-value]


def reference(
    pool: KVPool, batch: AttentionBatch, layer: int, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The torch backend on a copy of `pool`, in float32: given q and k as the kernel rounds
    them (normed and rotated), it writes them and attends."""
    copy = KVPool(pool.layout, pool.num_pages, "cpu", DTYPE)
    copy.pages.copy_(pool.pages)
    torch_attn = TorchAttention(copy, q.shape[1], q.shape[-1] ** -0.5)
    torch_attn.plan(batch)
    return torch_attn.forward(layer, q.float(), k.float(), v.float())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_split_kv() -> None:
    """`SplitKVDecode.forward` at batch 1 with the norms against the torch backend attending
    the normed, rotated q and k (and far from it without the norm, or with it after the
    rotary); without the norms, against the rotated q and k as before. The pool's slot holds
    the new k (normed, rotated) and v."""
    from workers.kernels.split_kv_decode import SplitKVDecode

    gen = torch.Generator().manual_seed(2)
    for hq, hkv, d in HEADS:
        for length in (1, 70):
            pool, batch, csr = decode_case(hq, hkv, d, length, seed=length + d)
            q, k, v, wq, wk = qkv_rows(1, hq, hkv, d, gen)
            # a position past the sequence's: at 0 the rotary is the identity (and so is a
            # norm's order with it)
            cos, sin = cos_sin(torch.tensor([length + 40]), d)
            kernel = SplitKVDecode(1, hq, hkv, d, d**-0.5, torch.device("cpu"))
            slot = (batch.slot_pages, 0, batch.slot_offsets)
            for layer, norm in ((0, QKNorm(wq, wk, EPS)), (1, None)):
                if norm is None:
                    rq, rk = rotated(q, cos, sin), rotated(k, cos, sin)
                    wrong: list[tuple[torch.Tensor, torch.Tensor]] = []
                else:
                    rq = normed_then_rotated(q, wq, cos, sin)
                    rk = normed_then_rotated(k, wk, cos, sin)
                    wrong = list(zip(wrong_orders(q, wq, cos, sin), wrong_orders(k, wk, cos, sin)))
                ref = reference(pool, batch, layer, rq, rk, v)
                out = kernel.forward(q, k, v, cos, sin, pool.layer(layer), *csr,
                                     batch.slot_pages, batch.slot_offsets, norm)  # fmt: skip
                assert out.shape == q.shape and out.dtype == DTYPE
                # fp16 q, K and probabilities against float32 math
                assert rel_err(out, ref) < 5e-3, (hq, d, length, layer, rel_err(out, ref))
                written = pool.layer(layer)[slot]
                assert_equal_but_rarely(written, rk)
                assert torch.equal(pool.layer(layer)[batch.slot_pages, 1, batch.slot_offsets], v)
                for bad_q, bad_k in wrong:
                    assert rel_err(written, bad_k) > 0.1, rel_err(written, bad_k)
                    if length > 1:  # one token's output is its v, whatever q and k are
                        bad = reference(pool, batch, layer, bad_q, bad_k, v)
                        assert rel_err(out, bad) > 0.05, rel_err(out, bad)


def check_rms_norm_strided() -> None:
    """`fused.rms_norm` of strided q/k heads (views of a packed q/k/v output, no copy) equals
    its result on the contiguous copy, and the torch arithmetic (`layers.rms_norm` on the CPU)
    up to the order of the sum of squares; other shapes as before."""
    from workers.kernels import fused

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for heads, d in ((9, 64), (32, 128)):
            packed = (torch.randn(7, heads + 4, d, generator=gen) * 5).to(dtype)
            x = packed[:, 2 : 2 + heads]  # strided rows: stride(0) != heads * d
            w = torch.randn(d, generator=gen).to(dtype)
            out = fused.rms_norm(x, w, EPS)
            assert out.is_contiguous() and out.shape == x.shape
            assert torch.equal(out, fused.rms_norm(x.contiguous(), w, EPS))
            ref = rms_norm(x, w, EPS)
            if dtype == torch.float16:
                assert_equal_but_rarely(out, ref)
            elif dtype == torch.float32:  # no rounding to hide 1/rms's last bit
                torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6)
            # (the interpreter truncates to bf16, torch rounds: bf16 only against itself)
        rows = (torch.randn(2, 3, 5, 64, generator=gen) * 5).to(dtype)  # 4-D, and 2-D
        w64 = w[:64]
        for x in (rows, rows[0, 0]):
            flat = fused.rms_norm(x.reshape(-1, 64), w64, EPS)
            assert torch.equal(fused.rms_norm(x, w64, EPS), flat.view(x.shape))


def test_rotary_store_with_qk_norm_interpreted() -> None:
    interpreted("check_rotary_store", __name__)


def test_rotary_store_int8_with_qk_norm_interpreted() -> None:
    interpreted("check_rotary_store_int8", __name__)


def test_split_kv_decode_with_qk_norm_interpreted() -> None:
    interpreted("check_split_kv", __name__)


def test_rms_norm_reads_strided_heads_interpreted() -> None:
    interpreted("check_rms_norm_strided", __name__)


class _RotaryBackend(TorchAttention):
    """The torch backend with a `forward_rotary` (as FlashInfer's), recording its `qk_norm`."""

    seen: list[QKNorm | None]

    def forward_rotary(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self.seen.append(qk_norm)
        if qk_norm is not None:
            q, k = qk_norm.apply(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.forward(layer_id, q, k, v)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attend_hands_the_qk_norms_to_forward_rotary(qk_norm: bool) -> None:
    """`Attention.attend` passes a Qwen3 layer's q/k norm weights to `forward_rotary` (which
    applies them) and does not apply them itself; a backend without `forward_rotary` gets q
    and k normed and rotated: both give the same output."""
    from workers.model.config import ModelConfig
    from workers.model.llama_attention import Attention
    from workers.parallel.group import SINGLE

    hq, hkv, d, hidden = 4, 2, 32, 64
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=16, hidden_size=hidden, intermediate_size=32,
        num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, rms_norm_eps=EPS,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
        qk_norm=qk_norm,
    )  # fmt: skip
    torch.manual_seed(0)
    attention = Attention(cfg, 0, SINGLE)
    for p in attention.parameters():
        p.data.normal_()
    outs = []
    for backend_type in (_RotaryBackend, TorchAttention):
        layout = KVLayout(num_layers=1, page_size=4, num_kv_heads=hkv, head_dim=d,
                          dtype="float32")  # fmt: skip
        pool = KVPool(layout, 4, "cpu", torch.float32)
        backend = backend_type(pool, hq, d**-0.5)
        seen_list: list[QKNorm | None] = []
        if isinstance(backend, _RotaryBackend):
            backend.seen = seen_list
        batch = AttentionBatch(q_lens=[3], kv_lens=[3], page_table=torch.tensor([[1]]),
                               slot_pages=torch.tensor([1, 1, 1]),
                               slot_offsets=torch.tensor([0, 1, 2]))  # fmt: skip
        backend.plan(batch)
        qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(1))
        cs = cos_sin(torch.arange(3), d, torch.float32)
        outs.append(attention.attend(qkv, cs, backend))
        if backend_type is _RotaryBackend:
            (seen,) = seen_list
            if qk_norm:
                assert attention.q_norm is not None and attention.k_norm is not None
                assert seen is not None and seen.eps == EPS
                assert seen.q_weight is attention.q_norm.weight
                assert seen.k_weight is attention.k_norm.weight
            else:
                assert seen is None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
