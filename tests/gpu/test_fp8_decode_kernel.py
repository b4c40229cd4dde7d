"""The FP8 paged decode-attention kernel (`kernels/fp8_decode.py`) on a GPU: against the torch
reference reading the same FP8 bytes, in a decode graph, and in the engine (SmolLM2's shape,
random weights) against the torch backend's tokens."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_engine_gpu import decode_trace
from tests.gpu.test_flashinfer_attention import HEADS, _cos_sin, _pad, qkv, random_batch, rel_err
from tests.gpu.test_fp8_kv_gpu import FP8_TOLERANCE, SCALES, fp8_pool
from workers.attention.base import AttentionBatch
from workers.attention.torch_ref import TorchAttention
from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.kernels.tuning import FP8DecodeLaunch
from workers.kvcache.pool import KVPool

pytestmark = pytest.mark.gpu
XQA_TOLERANCE = 0.06  # relative: FP8 products (q and the probabilities as e4m3), ~0.03 measured
XQA_NOISE = 0.3  # nats a top log-prob may move with them, SmolLM2's shape, random weights


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("merge", ["chosen", "last", "none"])
def test_fp8_decode_kernel_matches_reference(
    heads: str, page_size: int, batch: int, merge: str
) -> None:
    """Lengths not multiples of the page, one of a single token, one over a split's tiles;
    layers 1-2 have K and V scales other than 1. The splits merge as chosen (every split a
    slice where all programs fit at once: batch 1 on an H200; else the last to arrive all),
    or the last to arrive merges all, or one split writes the output directly. Twice: the
    merge counters are reused."""
    check_kernel(heads, page_size, batch, merge)


# Launches the H200's table does not pick at some batch size (`tuning.FP8DecodeLaunch()`: 4
# warps, tiles of 128), so every GPU tests each of them.
LAUNCHES = {"4-warps-128": {}, "1-warp-64": dict(tile=64, num_warps=1),
            "1-warp-32": dict(tile=32, num_warps=1, stages=4)}  # fmt: skip


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_fp8_decode_launches_match_reference(heads: str, launch: str) -> None:
    """Each launch, whatever this GPU's table picks, at 16 sequences on pages of 16."""
    check_kernel(heads, 16, 16, "chosen", FP8DecodeLaunch(**LAUNCHES[launch]))


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("splits", [1, 4])
def test_xqa_matches_reference(heads: str, batch: int, splits: int) -> None:
    """FlashInfer's XQA (`attention/xqa_decode.py`) as `check_kernel` checks the Triton one: to
    FP8 products' precision (q and the probabilities as e4m3)."""
    check_kernel(heads, 16, batch, "chosen", xqa_splits=splits)


def decode_case(
    tag: str, heads: str, page_size: int, batch: int
) -> tuple[int, list[int], KVPool, AttentionBatch]:
    """A decode batch of `batch` sequences over a random 16-bit pool: lengths not multiples of
    the page (odd), one of a single token, one over a split's tiles; its seed and lengths."""
    _, hkv, d = HEADS[heads]
    seed = zlib.crc32(f"{tag}/{heads}/{page_size}/{batch}".encode())
    gen = torch.Generator().manual_seed(seed)
    lens = (torch.randint(2, 1500, (batch,), generator=gen) | 1).tolist()
    lens[0], lens[-1] = (1, 4099) if batch > 1 else (4099, 4099)
    bf16, batch_ = random_batch("decode", page_size, hkv, d, seed, kv_lens=lens)
    return seed, lens, bf16, batch_


def reference_layers(
    pool: KVPool, batch: AttentionBatch, hq: int, seed: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Layers 0-2 of `batch`'s decode step on `pool`: each layer's q, and the torch reference's
    attention in float32, which first stores the step's new K/V into the pool."""
    rows, hkv, d = len(batch.q_lens), pool.layout.num_kv_heads, pool.layout.head_dim
    reference = TorchAttention(pool, hq, d**-0.5)
    reference.plan(batch)
    for layer in (0, 1, 2):
        q, k, v = qkv(rows, hq, hkv, d, seed + layer)
        yield layer, q, reference.forward(layer, q.float(), k.float(), v.float())


def check_kernel(
    heads: str, page_size: int, batch: int, merge: str, launch: FP8DecodeLaunch | None = None,
    xqa_splits: int = 0,
) -> None:  # fmt: skip
    """The kernel (`launch`, else the table's; XQA with `xqa_splits` splits where given)
    against the torch reference, three layers."""
    from workers.attention.paged_metadata import paged_metadata
    from workers.attention.xqa_decode import XQABuffers, XQADecode
    from workers.kernels.fp8_decode import FP8Decode

    hq, hkv, d = HEADS[heads]
    seed, lens, bf16, batch_ = decode_case("fp8k", heads, page_size, batch)
    pool = fp8_pool(bf16)
    meta = paged_metadata(batch_, page_size)
    kernel = FP8Decode(batch, hq, hkv, d, d**-0.5, pool.pages.device, launch,
                       splits=1 if merge == "none" else None)  # fmt: skip
    if merge == "last":
        kernel.parts.all_merge = False
    xqa = None
    if xqa_splits:
        buffers = XQABuffers(batch, batch_.page_table.shape[1] + 3, pool.pages.device)
        xqa = XQADecode(batch, hq, hkv, d, d**-0.5, page_size, torch.bfloat16, buffers,
                        xqa_splits)  # fmt: skip
        xqa.plan(batch_.page_table, torch.tensor(lens, dtype=torch.int32))
    for layer, q, ref in reference_layers(pool, batch_, hq, seed):
        for _ in range(2):
            if xqa is not None:
                out = xqa.forward(q, pool.layer(layer), SCALES.k[layer], SCALES.v[layer])
            else:
                out = kernel.forward(
                    q, pool.layer(layer), meta.kv_indptr.cuda(), meta.kv_indices,
                    meta.last_page_len.cuda(), SCALES.k[layer], SCALES.v[layer],
                )  # fmt: skip
            tolerance = XQA_TOLERANCE if xqa is not None else FP8_TOLERANCE
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
            assert rel_err(out, ref) < tolerance, (layer, rel_err(out, ref))


def replayed_decode_graphs(
    attn: Any, pool: KVPool, bf16: KVPool, hq: int, rows: int
) -> Iterator[tuple[AttentionBatch, int, torch.Tensor, list[torch.Tensor]]]:
    """`attn` (a decode graph's attention over `pool`, `rows` rows) captured at layer 1, then
    replayed twice after re-plans to other lengths, `pool` restored to its bytes before each:
    yields the padded batch, its live rows, the graph's output and its inputs q, k, v, cos,
    sin."""
    hkv, d = pool.layout.num_kv_heads, pool.layout.head_dim
    start = pool.pages.clone()
    q, k, v = (torch.zeros_like(t) for t in qkv(rows, hq, hkv, d, 0))
    cos, sin = (torch.zeros((rows, 1, d), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _, first = random_batch("decode", 16, hkv, d, seed=1, pool=bf16, kv_lens=[300] * rows)
    attn.plan(first)
    attn.forward_rotary(1, q, k, v, cos, sin)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward_rotary(1, q, k, v, cos, sin)
    for seed in (2, 3):
        lens = [1 + (97 * i + 31 * seed) % 900 for i in range(max(1, rows - 1))]
        _, batch = random_batch("decode", 16, hkv, d, seed, pool=bf16, kv_lens=lens)
        pool.pages.copy_(start)
        padded = _pad(batch, rows)
        new_cos, new_sin = _cos_sin(padded, d)
        for dst, src in zip((q, k, v, cos, sin), (*qkv(rows, hq, hkv, d, seed), new_cos, new_sin)):
            dst.copy_(src)
        attn.plan(padded)
        graph.replay()
        yield padded, len(lens), out, [q, k, v, cos, sin]


@pytest.mark.parametrize("kernel", ["triton", "xqa"])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_graph_decode_fp8_kernel_replays_with_rotary(rows: int, kernel: str) -> None:
    """A decode graph over an FP8 pool runs the kernel (`KernelConfig.fp8_decode_kernel`) after
    the quantizing rotary+store, and takes prefill rows (it reads nothing before its input is
    ready)."""
    from workers.attention.flashinfer import new_workspace
    from workers.attention.graph_decode import GraphDecodeAttention
    from workers.attention.xqa_decode import XQABuffers
    from workers.kernels import rope

    hq, hkv, d = HEADS["gqa-32/8-d128"]
    bf16, _ = random_batch("decode", 16, hkv, d, seed=0, kv_lens=[900] * rows)
    pool = fp8_pool(bf16)
    indices = torch.zeros(rows * 64, dtype=torch.int32, device="cuda")
    xqa = XQABuffers(rows, 64, pool.pages.device)
    attn = GraphDecodeAttention(pool, hq, d**-0.5, rows, new_workspace(pool.pages.device), indices,
                                xqa=xqa, fp8_kernel=kernel)  # fmt: skip
    assert (attn.xqa is not None, attn.fp8 is not None) == (kernel == "xqa", kernel == "triton")
    assert attn.split_kv is None and attn.accepts_token_rows
    tolerance = XQA_TOLERANCE if kernel == "xqa" else FP8_TOLERANCE
    graphs = replayed_decode_graphs(attn, pool, bf16, hq, rows)
    for padded, live, out, (q, _, v, cos, sin) in graphs:
        # The reference attends to the bytes the graph stored (the new k rotated in float32
        # and quantized: writing them again leaves them as they are) with q rotated as the
        # graph rotates it.
        stored_k = pool.layer(1)[padded.slot_pages, 0, padded.slot_offsets].float() * SCALES.k[1]
        reference = TorchAttention(pool, hq, d**-0.5)
        reference.plan(padded)
        ref = reference.forward(1, rope.rotary(q, cos, sin).float(), stored_k, v.float())
        assert rel_err(out[:live], ref[:live]) < tolerance


@pytest.mark.parametrize("kernel", ["triton", "xqa"])
def test_engine_fp8_graphs_give_torch_backend_tokens(smollm2_random: Path, kernel: str) -> None:
    """The engine with FP8 KV: decode graphs (the kernel asked for) against the torch backend,
    teacher-forced on the torch backend's tokens (so one near-tie cannot cascade): equal tokens
    unless the torch backend's top two were within FP8 noise."""
    common = dict(
        model=str(smollm2_random), device="cuda", dtype="bfloat16", kv_cache_memory_gb=1,
        kv_cache_dtype="fp8_e4m3", cuda_graph_batch_sizes=(1, 4),
    )  # fmt: skip
    fast = ModelRunner(EngineConfig(**common, kernels={"fp8_decode_kernel": kernel}))
    assert fast.graphs is not None
    assert all(getattr(a, "fp8" if kernel == "triton" else "xqa") is not None
               for a in fast.graphs.attn.values())  # fmt: skip
    slow = ModelRunner(EngineConfig(**common, attention_backend="torch", enforce_eager=True))
    assert_forced_tokens_match(fast, slow, 0.1 if kernel == "triton" else XQA_NOISE)


def assert_forced_tokens_match(fast: ModelRunner, slow: ModelRunner, noise: float) -> None:
    """`fast`'s decode steps (1 and 4 sequences) teacher-forced on `slow`'s tokens (so one
    near-tie cannot cascade): equal tokens unless `slow`'s top two were within `noise` nats,
    top-1 log-probs within `noise`."""
    steps = 6
    for num_seqs in (1, 4):
        prompts = [[(11 * j + 5 * i) % 4000 + 5 for j in range(40 + 9 * i)]
                   for i in range(num_seqs)]  # fmt: skip
        want, want_top1, want_gaps = decode_trace(slow, prompts, steps, None)
        got, got_top1, _ = decode_trace(fast, prompts, steps, want)
        for t in range(steps):
            for i in range(num_seqs):
                seen = (num_seqs, t, i, got_top1[t][i], want_top1[t][i], want_gaps[t][i])
                assert got[t][i] == want[t][i] or want_gaps[t][i] < noise, seen
                assert abs(got_top1[t][i] - want_top1[t][i]) < noise, seen
