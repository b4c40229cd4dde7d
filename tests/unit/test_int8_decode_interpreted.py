"""The int8 KV kernels in Triton's interpreter on the CPU: the paged decode attention
(`kernels/int8_decode.py`) against the torch backend reading the same int8 rows (dequantized
with their scales), and the rotary + int8 row write (`rope_int8.rotary_store_int8`) against the
torch path's rotary and `quantize_rows`. The GPU tests are tests/gpu/test_int8_kv_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.unit.test_fp8_decode_interpreted import HKV, HQ, LENS, PAGE, D, shuffled_pages
from workers.attention.base import AttentionBatch
from workers.attention.torch_ref import TorchAttention
from workers.kvcache.int8_rows import hadamard, quantize_rows
from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout

pytest.importorskip("triton")

# Rows of very different magnitudes (a per-row scale's reason): per KV head and token.
MAGNITUDES = (1e-3, 1.0, 40.0)


def paged_batch() -> tuple[KVPool, AttentionBatch, list[torch.Tensor]]:
    """An int8 pool of random K/V rows of mixed magnitudes, LENS's sequences on shuffled pages
    (the new token of each already stored), and their page table in FlashInfer's CSR form."""
    gen = torch.Generator().manual_seed(0)
    pages = [-(-n // PAGE) for n in LENS]
    layout = KVLayout(num_layers=2, page_size=PAGE, num_kv_heads=HKV, head_dim=D, dtype="int8")
    pool = KVPool(layout, sum(pages) + 3, "cpu", torch.bfloat16)
    shape = pool.pages.shape[:-1]
    mags = torch.tensor(MAGNITUDES)[torch.randint(len(MAGNITUDES), shape, generator=gen)]
    pool.pages.copy_(quantize_rows(torch.randn(*shape, D, generator=gen) * mags[..., None]))
    batch, csr = shuffled_pages(pool, gen)
    return pool, batch, csr


def check(splits: int, tile: int = 16) -> None:
    """The kernel (q and its output rotated by H around it, as the backend does) against the
    reference with `splits` splits and tiles of `tile` tokens (several pages, or part of
    one); run with TRITON_INTERPRET=1."""
    from workers.kernels.int8_decode import Int8Decode
    from workers.kernels.tuning import FP8DecodeLaunch

    pool, batch, csr = paged_batch()
    q = torch.randn(len(LENS), HQ, D, generator=torch.Generator().manual_seed(1)) * 3
    h = hadamard(D, torch.device("cpu"))
    assert h is not None
    reference = TorchAttention(pool, HQ, D**-0.5)
    reference.plan(batch)
    kernel = Int8Decode(len(LENS), HQ, HKV, D, D**-0.5, torch.device("cpu"),
                        FP8DecodeLaunch(tile=tile, stages=1), splits)  # fmt: skip
    for layer in (0, 1):
        # The reference reads q as the kernel does (fp16, rotated), the pool as it is: what
        # is left is the probabilities' fp16 (10 bits) against float32.
        ref = reference._attend(layer, (q @ h).half().float() @ h, reference._groups[0])
        out = kernel.forward(q @ h, pool.layer(layer), *csr) @ h
        assert out.dtype == torch.float32
        err = float((out - ref).norm() / ref.norm())
        worst = float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
        assert err < 5e-4 and worst < 5e-3, (splits, layer, err, worst)
    assert kernel.parts.all_merge is False


def check_store() -> None:
    """The rows `rotary_store_int8` writes against `quantize_rows` of the rotated k and of v,
    in float32 (the interpreter truncates to bf16 where the GPU rounds to nearest): the same
    int8 values, scales equal but for the Hadamard products' order of sums."""
    from workers.attention.rotary import RotaryEmbedding
    from workers.kernels import rope_int8

    gen = torch.Generator().manual_seed(2)
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128), (4, 1, 32)):
        tokens = 5
        kv = torch.zeros(6, 3, 2, PAGE, hkv, d + 4, dtype=torch.int8)[:, 1]  # a layer's view
        q, k, v = (torch.randn(tokens, h, d, generator=gen) for h in (hq, hkv, hkv))
        k[0, 0], v[1, 0] = 0.0, v[1, 0] * 1e-3  # a zero row, a small one
        pos = torch.arange(tokens) * 7 + 3
        cos, sin = RotaryEmbedding(d, 10000.0, None).cos_sin(pos, torch.float32)
        pages, slots = torch.tensor([1, 2, 2, 5, 3]), torch.tensor([0, 1, 3, 2, 0])
        half = hadamard(d // 2, torch.device("cpu"))
        assert half is not None
        out = rope_int8.rotary_store_int8(q, k, v, cos, sin, kv, half, pages, slots)
        rotated = [x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin
                   for x in (q, k)]  # fmt: skip
        torch.testing.assert_close(out, rotated[0], rtol=0, atol=1e-6)
        for kv_index, x in ((0, rotated[1]), (1, v)):
            got, want = kv[pages, kv_index, slots], quantize_rows(x)
            assert torch.equal(got[..., :d], want[..., :d]), (d, kv_index)
            scales = [r[..., d:].contiguous().view(torch.float32) for r in (got, want)]
            torch.testing.assert_close(*scales, rtol=2e-6, atol=0)
        # For the decode kernel: q times H in float32 too, the same rows written
        written = kv.clone()
        q_by_h = rope_int8.rotary_store_int8(q, k, v, cos, sin, kv, half, pages, slots,
                                             rotate_q_by_h=True)  # fmt: skip
        h = hadamard(d, torch.device("cpu"))
        assert h is not None and q_by_h.dtype == torch.float32
        torch.testing.assert_close(q_by_h, rotated[0] @ h, rtol=0, atol=1e-5)
        assert torch.equal(kv, written)


def test_int8_kernels_interpreted_match_torch() -> None:
    """Decode with one split (the output written directly) and four (merged by the last to
    arrive), tiles of four pages and of half a page, then the write (`check_store`). In a
    process of its own: TRITON_INTERPRET must be set before Triton is first imported."""
    code = f"from {__name__} import check, check_store; check(1); check(4); check(2, tile=2); "
    code += "check_store()"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
