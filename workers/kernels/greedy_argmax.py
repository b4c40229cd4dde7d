"""The greedy token of each row of CUDA logits in two Triton launches (`sampler.argmax_rows`).

torch's `argmax` reduces a row in one thread block (37 µs for Llama-3's 128k logits on an H200);
the chunked torch form that replaced it is four kernels, ~14 µs of a batch-1 decode step. Here
each row is cut into <= 256 chunks, one program each (first launch), and one program a row picks
the first chunk holding the row's maximum (second); both launch with programmatic dependent
launch (`workers/kernels/pdl.py`). The answer is torch's: the first index of the maximum, a NaN
counting as the maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import pdl
from workers.kernels.pdl import start_dependents, wait_for_inputs

MAX_CHUNKS = 256
MIN_CHUNK = 256
# Chunk programs a launch aims at, rows times chunks: 64 rows of 128k float32 logits after the
# LM head took 21.3 µs in 64 x 256 programs of 4 warps, 14.2 µs in 64 x 32 of 8 (H200).
PROGRAMS = 2048
CHUNK_WARPS = 8


@triton.jit
def _first_max(v, index, mask):
    """The maximum of `v` where `mask` (NaN if any is NaN) and the smallest `index` holding it."""
    nan = (v != v) & mask
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(mask & ~nan, v, float("-inf")), axis=0)
    holds = tl.where(any_nan, nan, mask & (v == top))
    first = tl.min(tl.where(holds, index, 2**31 - 1), axis=0)
    return tl.where(any_nan, float("nan"), top), first


@triton.jit
def _chunk_max_kernel(
    x_ptr, top_ptr, at_ptr, stride_x, vocab, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    start_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < CHUNK) & (index < vocab)
    wait_for_inputs(PDL)
    v = tl.load(x_ptr + row * stride_x + index, mask=mask, other=float("-inf")).to(tl.float32)
    top, first = _first_max(v, index, mask)
    slot = row * tl.num_programs(1) + chunk
    tl.store(top_ptr + slot, top)
    tl.store(at_ptr + slot, first)


@triton.jit
def _pick_chunk_kernel(top_ptr, at_ptr, out_ptr, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < chunks
    wait_for_inputs(PDL)
    top = tl.load(top_ptr + row * chunks + c, mask=mask, other=float("-inf"))
    _, best = _first_max(top, c, mask)
    tl.store(out_ptr + row, tl.load(at_ptr + row * chunks + best).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-D CUDA tensor whose last dimension is contiguous (int64)."""
    rows, vocab = x.shape
    assert x.stride(-1) == 1 and vocab > 0
    chunks = min(MAX_CHUNKS, triton.cdiv(vocab, MIN_CHUNK), triton.cdiv(PROGRAMS, max(rows, 1)))
    chunk = triton.cdiv(vocab, chunks)
    chunks = triton.cdiv(vocab, chunk)  # none empty
    top = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    at = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        options = pdl.launch_options(x)
        _chunk_max_kernel[(rows, chunks)](
            x, top, at, x.stride(0), vocab, CHUNK=chunk, BLOCK=triton.next_power_of_2(chunk),
            num_warps=CHUNK_WARPS, **options,
        )  # fmt: skip
        _pick_chunk_kernel[(rows,)](
            top, at, out, chunks, BLOCK=triton.next_power_of_2(chunks), num_warps=4, **options
        )
    return out
