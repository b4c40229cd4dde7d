"""FP8 KV cache on a GPU: FlashInfer's FP8 paged kernels and the fused rotary+store kernel
against the torch reference reading the same FP8 bytes (SmolLM2's real weights with FP8 KV:
`test_smollm2_gpu.py`)."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.gpu.test_flashinfer_attention import (
    HEADS,
    MAX_KV,
    _pad,
    qkv,
    random_batch,
    rel_err,
)
from workers.attention.torch_ref import TorchAttention
from workers.kvcache.kv_dtype import KVScales, quantize
from workers.kvcache.pool import KVPool

pytestmark = pytest.mark.gpu

FP8_TOLERANCE = 1e-2  # both sides read the same FP8 bytes: only bf16 operands and order differ
SCALES = KVScales((1.0, 0.5, 2.0), (1.0, 0.25, 4.0))  # layer 0 as vLLM's default, 1-2 not


def fp8_pool(pool: KVPool) -> KVPool:
    """`pool`'s layout and (random) contents in FP8, with SCALES."""
    layout = pool.layout.model_copy(update={"dtype": "float8_e4m3fn"})
    fp8 = KVPool(layout, pool.num_pages, "cuda", torch.bfloat16, SCALES)
    fp8.pages.copy_(pool.pages)
    return fp8


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("layer", [0, 2])
def test_flashinfer_fp8_matches_torch_reference(heads: str, kind: str, layer: int) -> None:
    from workers.attention.flashinfer import FlashInferAttention

    hq, hkv, d = HEADS[heads]
    seed = zlib.crc32(f"fp8/{heads}/{kind}".encode())
    bf16, batch = random_batch(kind, 16, hkv, d, seed)
    pool = fp8_pool(bf16)
    q, k, v = qkv(batch.num_tokens, hq, hkv, d, seed)
    fast = FlashInferAttention(pool, hq, d**-0.5)
    fast.plan(batch)
    out = fast.forward(layer, q, k, v)
    stored = pool.layer(layer)[batch.slot_pages, 0, batch.slot_offsets]
    want = quantize(k, pool.pages.dtype, SCALES.k[layer])
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    ref_backend = TorchAttention(pool, hq, d**-0.5)
    ref_backend.plan(batch)
    ref = ref_backend.forward(layer, q.float(), k.float(), v.float())  # dequantized, float32
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, ref) < FP8_TOLERANCE


@pytest.mark.parametrize("rows", [1, 12])
def test_graph_decode_fp8_replays_new_batches(rows: int) -> None:
    """Batch 1 leaves the 16-bit split-KV kernel for the FP8 kernel (`fp8_decode`, or
    FlashInfer's decode where that was measured the faster); both sizes replay."""
    from workers.attention.flashinfer import new_workspace
    from workers.attention.graph_decode import GraphDecodeAttention
    from workers.kernels import fp8_decode

    hq, hkv, d = HEADS["gqa-32/8-d128"]
    # a pool with pages for `rows` sequences: the batches below take their pages from it
    bf16, _ = random_batch("decode", 16, hkv, d, seed=0, kv_lens=[MAX_KV] * rows)
    pool = fp8_pool(bf16)
    indices = torch.zeros(rows * 4096, dtype=torch.int32, device="cuda")
    attn = GraphDecodeAttention(pool, hq, d**-0.5, rows, new_workspace(pool.pages.device), indices)
    assert attn.split_kv is None and (attn.fp8 is not None) == fp8_decode.used_at(rows)
    q, k, v = (torch.zeros_like(t) for t in qkv(rows, hq, hkv, d, 0))
    _, first = random_batch("decode", 16, hkv, d, seed=1, pool=bf16, kv_lens=[300] * rows)
    attn.plan(_pad(first, rows))
    attn.forward(2, q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(2, q, k, v)
    for seed in (2, 3):
        lens = [100 + 37 * i for i in range(max(1, rows - 2))]
        _, batch = random_batch("decode", 16, hkv, d, seed, pool=bf16, kv_lens=lens)
        pool.pages.copy_(bf16.pages)
        padded = _pad(batch, rows)
        for dst, src in zip((q, k, v), qkv(rows, hq, hkv, d, seed)):
            dst.copy_(src)
        attn.plan(padded)
        graph.replay()
        ref_backend = TorchAttention(pool, hq, d**-0.5)
        ref_backend.plan(padded)
        ref = ref_backend.forward(2, q.float(), k.float(), v.float())
        assert rel_err(out[: len(lens)], ref[: len(lens)]) < FP8_TOLERANCE


def test_rotary_store_quantizes_as_the_torch_write() -> None:
    from workers.attention.rotary import apply_rotary
    from workers.kernels import rope

    tokens, hq, hkv, d = 40, 32, 8, 128
    q, k, v = qkv(tokens, hq, hkv, d, seed=5)
    k, v = k * 300, v * 3  # some K past FP8's 448 at scale 0.5: saturated, not NaN
    pos = torch.arange(tokens, device="cuda")
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    angles = torch.cat([pos[:, None] * inv] * 2, dim=-1)[:, None]
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    pages = torch.zeros(8, 2, 16, hkv, d, dtype=torch.float8_e4m3fn, device="cuda")
    slot_pages, slot_offsets = pos // 16 + 1, pos % 16
    rope.rotary_store(q, k, v, cos, sin, pages, slot_pages, slot_offsets, 0.5, 0.25)
    want_k = quantize(apply_rotary(k, cos, sin).float(), pages.dtype, 0.5).float()
    want_v = quantize(v.float(), pages.dtype, 0.25).float()
    got_k = pages[slot_pages, 0, slot_offsets].float()
    got_v = pages[slot_pages, 1, slot_offsets].float()
    assert torch.isfinite(got_k).all() and got_k.abs().max() == 448
    # K: rotated in float32 (Triton) or rounded to bf16 first (torch): at most one FP8 step
    assert torch.allclose(got_k, want_k, rtol=0.13, atol=2**-8) and torch.equal(got_v, want_v)
