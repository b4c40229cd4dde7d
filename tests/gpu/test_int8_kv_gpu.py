"""The int8 KV cache on the flashinfer backend (a GPU): the Triton decode kernel
(`kernels/int8_decode.py`) against the torch reference reading the same int8 rows, the rotary +
int8 write kernel (`rope_int8.rotary_store_int8`, with Qwen3's q/k norms too) against the torch
path's rows, the backend's prefill/decode/mixed steps and writes, a decode graph with the rotary
embedding, and the engine (SmolLM2's shape, random weights) against the torch backend's tokens.
SmolLM2's real weights against HF float32: tests/gpu/test_smollm2_gpu.py (`-k int8`)."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import pytest
import torch

from tests.gpu.test_flashinfer_attention import (
    BF16_TOLERANCE,
    HEADS,
    _cos_sin,
    qkv,
    random_batch,
    rel_err,
)
from tests.gpu.test_fp8_decode_kernel import (
    assert_forced_tokens_match,
    decode_case,
    reference_layers,
    replayed_decode_graphs,
)
from tests.gpu.test_fused_kernels import qk_norm_weights, strided_qkv, unfused_orders
from workers.attention.torch_ref import TorchAttention
from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.kvcache.int8_rows import hadamard, quantize_rows
from workers.kvcache.pool import KVPool

pytestmark = pytest.mark.gpu
# ||out - ref|| / ||ref|| against float32 math over the same rows: the kernel's fp16 q and
# probabilities land near 1e-3 on random data
KERNEL_TOLERANCE = 5e-3


def int8_pool(pool: KVPool, seed: int = 0) -> KVPool:
    """`pool`'s layout as int8 rows of random bytes, each with a random scale over three orders
    of magnitude (drawn rather than quantized: rotating a pool of 4099-token sequences in
    float32 would take seconds)."""
    layout = pool.layout.model_copy(update={"dtype": "int8"})
    int8 = KVPool(layout, pool.num_pages, "cuda", torch.bfloat16)
    gen = torch.Generator("cuda").manual_seed(seed)
    d = layout.head_dim
    int8.pages[..., :d].random_(-127, 128, generator=gen)
    rows = (*int8.pages.shape[:-1], 1)
    scales = (torch.rand(rows, generator=gen, device="cuda") * 7 - 5).exp() / 127  # e^-5..e^2
    int8.pages[..., d:] = scales.view(torch.int8)
    return int8


# (page size, batch, merge): every page size and batch with the merge as chosen, the others at 16
CASES = [(p, b, "chosen") for p in (1, 16) for b in (1, 16, 64)]
CASES += [(16, 16, "last"), (16, 16, "none")]


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize(("page_size", "batch", "merge"), CASES)
def test_int8_decode_kernel_matches_reference(
    heads: str, page_size: int, batch: int, merge: str
) -> None:
    """Lengths not multiples of the page, one of a single token, one over a split's tiles; the
    splits merged as chosen (every split a slice where all programs fit at once), by the last
    to arrive, or one split. Twice: the merge counters are reused."""
    from workers.attention.paged_metadata import paged_metadata
    from workers.kernels.int8_decode import Int8Decode

    hq, hkv, d = HEADS[heads]
    seed, _, bf16, batch_ = decode_case("int8k", heads, page_size, batch)
    pool = int8_pool(bf16)
    meta = paged_metadata(batch_, page_size)
    kernel = Int8Decode(batch, hq, hkv, d, d**-0.5, pool.pages.device,
                        splits=1 if merge == "none" else None)  # fmt: skip
    if merge == "last":
        kernel.parts.all_merge = False
    h = hadamard(d, pool.pages.device)
    assert h is not None
    for layer, q, ref in reference_layers(pool, batch_, hq, seed):
        for _ in range(2):
            out = kernel.forward(
                q.float() @ h, pool.layer(layer), meta.kv_indptr.cuda(), meta.kv_indices,
                meta.last_page_len.cuda(),
            ) @ h  # fmt: skip
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < KERNEL_TOLERANCE, (layer, rel_err(out, ref))


def test_int8_decode_kernel_reads_pages_past_8_gib() -> None:
    """The same batch on pages more than 2^33 bytes into the pool (a page's stride spans every
    layer, so a large pool's row offsets pass 32 bits, even counted in 4-byte words): the
    attention the pages at the pool's start give."""
    from workers.attention.paged_metadata import paged_metadata
    from workers.kernels.int8_decode import Int8Decode

    hq, hkv, d = HEADS["gqa-32/8-d128"]
    seed, _, bf16, batch = decode_case("int8far", "gqa-32/8-d128", 16, 4)
    near = int8_pool(bf16)
    used = near.num_pages
    far_start = -(-(2**33 + 2**20) // near.layout.page_bytes)  # the first far page's offset
    far = KVPool(near.layout, far_start + used, "cuda", torch.bfloat16)
    far.pages[far_start:] = near.pages
    far_batch = dataclasses.replace(batch, page_table=batch.page_table + far_start,
                                    slot_pages=batch.slot_pages + far_start)  # fmt: skip
    h = hadamard(d, near.pages.device)
    assert h is not None
    q = torch.randn(4, hq, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    outs = []
    for pool, step in ((near, batch), (far, far_batch)):
        meta = paged_metadata(step, 16)
        kernel = Int8Decode(4, hq, hkv, d, d**-0.5, pool.pages.device)
        outs.append(kernel.forward(q @ h, pool.layer(1), meta.kv_indptr.cuda(),
                                   meta.kv_indices, meta.last_page_len.cuda()))  # fmt: skip
    del far
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


def assert_rows_match(got: torch.Tensor, want: torch.Tensor) -> None:
    """int8 rows `[..., D + 4]` as `quantize_rows` wrote them, but for the order of the
    Hadamard products' sums and a bf16 step of a rotated k value where the two compiled its
    rotary differently (each moves a scale by < 2^-8 and a value by < 1 step): a wrong
    rotation, scale or slot moves them by far more."""
    d = got.shape[-1] - 4
    assert int((got[..., :d].int() - want[..., :d].int()).abs().max()) <= 2
    assert float((got[..., :d] != want[..., :d]).float().mean()) < 0.05
    scales = [r[..., d:].contiguous().view(torch.float32) for r in (got, want)]
    torch.testing.assert_close(*scales, rtol=1e-2, atol=0)


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_rotary_store_int8_writes_the_torch_paths_rows(heads: str, tokens: int) -> None:
    """The fused write against `rope.rotary` then `quantize_rows` (bf16, as the engine runs)."""
    from workers.kernels import rope, rope_int8

    hq, hkv, d = HEADS[heads]
    bf16, batch = random_batch("decode", 16, hkv, d, seed=tokens, kv_lens=[40] * tokens)
    pool = int8_pool(bf16)
    q, k, v = qkv(tokens, hq, hkv, d, tokens)
    k[0, 0] = 0.0  # a zero row: scale 0, zeros
    cos, sin = _cos_sin(batch, d)
    half = hadamard(d // 2, pool.pages.device)
    assert half is not None
    out = rope_int8.rotary_store_int8(q, k, v, cos, sin, pool.layer(1), half.contiguous(),
                                      batch.slot_pages, batch.slot_offsets)  # fmt: skip
    assert rel_err(out, rope.rotary(q, cos, sin)) < 1e-3
    layer = pool.layer(1)
    want_k = quantize_rows(rope.rotary(k, cos, sin))
    assert_rows_match(layer[batch.slot_pages, 0, batch.slot_offsets], want_k)
    assert_rows_match(layer[batch.slot_pages, 1, batch.slot_offsets], quantize_rows(v))


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("by_h", [False, True])
def test_rotary_store_int8_applies_the_qk_norms_first(heads: str, by_h: bool) -> None:
    """With `qk_norm` (Qwen3), both q paths: q (rotated, or that times H in float32) and the
    k rows are the unfused path's (`fused.rms_norm`, `rope.rotary`, `quantize_rows`); far from
    the norm dropped or applied after the rotary (an int8 row is its own scale's: the weights
    tell them apart). At 8 warps (`rotary_store_int8` with norms)."""
    from workers.kernels import rope_int8

    hq, hkv, d = HEADS[heads]
    tokens = 64
    bf16, batch = random_batch("decode", 16, hkv, d, seed=tokens, kv_lens=[40] * tokens)
    pool = int8_pool(bf16)
    q, k, v = strided_qkv(tokens, hq, hkv, d, torch.bfloat16, seed=d)
    norm = qk_norm_weights(d, torch.bfloat16)
    cos, sin = _cos_sin(batch, d)
    half, h = hadamard(d // 2, pool.pages.device), hadamard(d, pool.pages.device)
    assert half is not None and h is not None
    out = rope_int8.rotary_store_int8(q, k, v, cos, sin, pool.layer(1), half.contiguous(),
                                      batch.slot_pages, batch.slot_offsets, rotate_q_by_h=by_h,
                                      qk_norm=norm)  # fmt: skip
    want_q, wrong_q = unfused_orders(q, norm.q_weight, cos, sin)
    if by_h:
        want_q, wrong_q = want_q.float() @ h, [bad.float() @ h for bad in wrong_q]
    assert out.dtype == want_q.dtype and rel_err(out, want_q) < 1e-3
    assert all(rel_err(out, bad) > 0.1 for bad in wrong_q)
    want_k, wrong_k = unfused_orders(k, norm.k_weight, cos, sin)
    stored = pool.layer(1)[batch.slot_pages, 0, batch.slot_offsets]
    assert_rows_match(stored, quantize_rows(want_k))
    for bad in wrong_k:
        diff = (stored[..., :d].float() - quantize_rows(bad)[..., :d].float()).abs().mean()
        assert float(diff) > 5
    assert_rows_match(pool.layer(1)[batch.slot_pages, 1, batch.slot_offsets], quantize_rows(v))


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_flashinfer_int8_matches_torch_reference(heads: str, kind: str) -> None:
    """The backend's step on an int8 pool (`forward`: q and k given rotated, the rows written
    by `store_kv`'s torch ops), then decode (the kernel) or prefill (FlashInfer over
    dequantized pages) against the torch backend over the same rows."""
    from workers.attention.flashinfer import FlashInferAttention

    hq, hkv, d = HEADS[heads]
    seed = zlib.crc32(f"int8/{heads}/{kind}".encode())
    bf16, batch = random_batch(kind, 16, hkv, d, seed)
    pool = int8_pool(bf16)
    q, k, v = qkv(batch.num_tokens, hq, hkv, d, seed)
    fast = FlashInferAttention(pool, hq, d**-0.5)
    for layer in (0, 2):
        fast.plan(batch)
        out = fast.forward(layer, q, k, v)
        stored = pool.layer(layer)[batch.slot_pages, 0, batch.slot_offsets]
        assert torch.equal(stored, quantize_rows(k))
        ref_backend = TorchAttention(pool, hq, d**-0.5)
        ref_backend.plan(batch)
        ref = ref_backend.forward(layer, q.float(), k.float(), v.float())  # float32 math
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_err(out, ref) < BF16_TOLERANCE, (layer, rel_err(out, ref))


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_graph_decode_int8_replays_with_rotary(rows: int) -> None:
    """A decode graph over an int8 pool: the rotary + int8 write kernel and the decode
    kernel, replayed after re-plans; it takes prefill rows."""
    from workers.attention.flashinfer import new_workspace
    from workers.attention.graph_decode import GraphDecodeAttention
    from workers.kernels import rope

    hq, hkv, d = HEADS["gqa-32/8-d128"]
    bf16, _ = random_batch("decode", 16, hkv, d, seed=0, kv_lens=[900] * rows)
    pool = int8_pool(bf16)
    indices = torch.zeros(rows * 64, dtype=torch.int32, device="cuda")
    attn = GraphDecodeAttention(pool, hq, d**-0.5, rows, new_workspace(pool.pages.device),
                                indices)  # fmt: skip
    assert attn.int8 is not None and attn.split_kv is None and attn.accepts_token_rows
    cos = torch.zeros((rows, 1, d), dtype=torch.bfloat16, device="cuda")
    assert attn.rotary_store(1, cos, cos) is None  # no int8 rows in the q/k/v GEMM epilogue
    graphs = replayed_decode_graphs(attn, pool, bf16, hq, rows)
    for padded, live, out, (q, k, _, cos, sin) in graphs:
        q_rot, k_rot = rope.rotary(q, cos, sin), rope.rotary(k, cos, sin)
        stored = pool.layer(1)[padded.slot_pages, 0, padded.slot_offsets]
        assert_rows_match(stored[:live], quantize_rows(k_rot)[:live])
        # The reference reads the rows the graph stored (attending, not writing again).
        reference = TorchAttention(pool, hq, d**-0.5)
        reference.plan(padded)
        ref = reference._attend(1, q_rot.float(), reference._groups[0])
        assert rel_err(out[:live], ref[:live]) < BF16_TOLERANCE


def test_engine_int8_graphs_give_torch_backend_tokens(smollm2_random: Path) -> None:
    """The engine with int8 KV: flashinfer's decode graphs against the torch backend (eager),
    teacher-forced on the torch backend's tokens: equal tokens unless the torch backend's top
    two were within the kernels' noise."""
    common = dict(
        model=str(smollm2_random), device="cuda", dtype="bfloat16", kv_cache_memory_gb=1,
        kv_cache_dtype="int8", cuda_graph_batch_sizes=(1, 4),
    )  # fmt: skip
    fast = ModelRunner(EngineConfig(**common, attention_backend="flashinfer"))
    assert fast.graphs is not None
    assert all(a.int8 is not None for a in fast.graphs.attn.values())
    slow = ModelRunner(EngineConfig(**common, attention_backend="torch", enforce_eager=True))
    assert_forced_tokens_match(fast, slow, 0.1)
