"""The FP8 paged decode-attention kernel (`kernels/fp8_decode.py`) in Triton's interpreter on
the CPU, against the torch backend reading the same FP8 bytes (dequantized). Runs where Triton
is installed (its interpreter needs no GPU); the GPU tests are tests/gpu/test_fp8_decode_kernel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from workers.attention.base import AttentionBatch
from workers.attention.torch_ref import TorchAttention
from workers.kvcache.kv_dtype import KVScales
from workers.kvcache.pool import KVPool
from workers.protocol import KVLayout

pytest.importorskip("triton")

HQ, HKV, D, PAGE = 8, 2, 32, 4
LENS = [1, 7, 70, 33]  # one token, and lengths that end mid-page
SCALES = KVScales((1.0, 0.5), (1.0, 2.0))


def paged_batch() -> tuple[KVPool, AttentionBatch, list[torch.Tensor]]:
    """An FP8 pool of random K/V, LENS's sequences on shuffled pages (the new token of each
    already stored), and their page table in FlashInfer's CSR form."""
    gen = torch.Generator().manual_seed(0)
    pages = [-(-n // PAGE) for n in LENS]
    layout = KVLayout(num_layers=2, page_size=PAGE, num_kv_heads=HKV, head_dim=D,
                      dtype="float8_e4m3fn")  # fmt: skip
    pool = KVPool(layout, sum(pages) + 3, "cpu", torch.bfloat16, SCALES)
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(pool.pages.dtype))
    batch, csr = shuffled_pages(pool, gen)
    return pool, batch, csr


def shuffled_pages(pool: KVPool, gen: torch.Generator) -> tuple[AttentionBatch, list[torch.Tensor]]:
    """LENS's sequences on shuffled pages of `pool` (the new token of each already stored), and
    their page table in FlashInfer's CSR form."""
    pages = [-(-n // PAGE) for n in LENS]
    owned = (torch.randperm(pool.num_pages - 1, generator=gen) + 1).int()
    table = torch.zeros(len(LENS), max(pages), dtype=torch.int32)
    indptr = [0]
    for row, n in enumerate(pages):
        table[row, :n] = owned[indptr[-1] : indptr[-1] + n]
        indptr.append(indptr[-1] + n)
    last = [n - (p - 1) * PAGE for n, p in zip(LENS, pages)]
    batch = AttentionBatch(
        q_lens=[1] * len(LENS),
        kv_lens=LENS,
        page_table=table,
        slot_pages=torch.tensor([int(table[i, (n - 1) // PAGE]) for i, n in enumerate(LENS)]),
        slot_offsets=torch.tensor([(n - 1) % PAGE for n in LENS]),
    )
    csr = [torch.tensor(indptr, dtype=torch.int32), owned[: indptr[-1]],
           torch.tensor(last, dtype=torch.int32)]  # fmt: skip
    return batch, csr


def check(splits: int) -> None:
    """The kernel against the reference with `splits` splits; run with TRITON_INTERPRET=1."""
    from workers.kernels.fp8_decode import FP8Decode
    from workers.kernels.tuning import FP8DecodeLaunch

    pool, batch, csr = paged_batch()
    q = torch.randn(len(LENS), HQ, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = TorchAttention(pool, HQ, D**-0.5)
    reference.plan(batch)
    kernel = FP8Decode(len(LENS), HQ, HKV, D, D**-0.5, torch.device("cpu"),
                       FP8DecodeLaunch(tile=16, stages=1), splits)  # fmt: skip
    for layer in (0, 1):
        ref = reference._attend(layer, q.float(), reference._groups[0])  # the pool as it is
        out = kernel.forward(q, pool.layer(layer), *csr, SCALES.k[layer], SCALES.v[layer])
        assert out.dtype == torch.bfloat16
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 1e-2, (splits, layer, err)
    assert kernel.parts.all_merge is False


def test_fp8_decode_kernel_interpreted_matches_torch() -> None:
    """One split (the output written directly) and four (merged by the last to arrive: the
    interpreter runs programs one after another, so none may wait for another). In a process
    of its own: Triton takes TRITON_INTERPRET into account where a function is decorated,
    its own library's included, so it must be set before Triton is first imported."""
    code = f"from {__name__} import check; check(1); check(4)"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
