"""Decode attention over an FP8 paged pool with FlashInfer's XQA kernel (Hopper).

XQA (TensorRT-LLM's decode kernel, shipped in FlashInfer) on SM90 reads FP8 pages with TMA in
producer warps while consumer warps run FP8 tensor-core products: q and the probabilities are
cast to e4m3 (q as it is, the probabilities scaled by 448). On an H200 with Llama-3-8B heads it
reads FP8 K/V at 1.05-1.10x the floor from 64 sequences up, against 1.45x for the Triton kernel
(`kernels/fp8_decode.py`), whose fp16 products are ~17x more exact on random data (relative
error 0.0017 against 0.028; docs/notes/fp8-kv.md). `KernelConfig.fp8_decode_kernel` picks.

XQA takes a dense page table (`[batch, pages per sequence]`, its row length the longest
sequence it serves) and uint32 sequence lengths, both fixed buffers here so that a CUDA graph
captured over `forward` reads each step's values. Its splits of a sequence come from the
multiprocessor count it is told (`_sm_count_for`), which is how the launch table's `programs`
reaches it.
"""

from __future__ import annotations

import math

import torch

from workers.kernels import pdl
from workers.kernels.split_kv_common import num_splits
from workers.kernels.tuning import xqa_programs

PAGE_SIZES = (16, 32, 64, 128)  # XQA's pages
_SEMAPHORE_BYTES = 8 * 2**20  # as FlashInfer reserves; the kernel leaves them zero after use
_SCRATCH_BYTES = 64 * 2**20  # the splits' partial outputs
DEFAULT_PROGRAMS = 1024  # asked for without a table: the H200's best at 16 and 64 sequences


def applies(page_size: int, head_dim: int, device: torch.device) -> bool:
    """Whether XQA's Hopper FP8 kernel serves this pool: SM90, its page sizes, d <= 256."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and page_size in PAGE_SIZES
        and head_dim <= 256
    )


def _sm_count_for(splits: int, batch_size: int, num_kv_heads: int) -> int:
    """The multiprocessor count that makes XQA split each sequence in `splits`: it takes
    `round(sm_count * 3 / (batch * kv_heads) / 4)` (at least 1)."""
    return math.ceil(splits * batch_size * num_kv_heads * 4 / 3)


def splits_for(
    batch_size: int, num_kv_heads: int, gpu_name: str, choice: str | None, served: bool
) -> int:
    """XQA's splits of each sequence for decode graphs of `batch_size`, 0 for the Triton kernel:
    `choice` (`KernelConfig.fp8_decode_kernel`), else the GPU's table (`tuning.xqa_programs`).
    `served`: whether XQA serves the pool (`applies`)."""
    if choice == "triton":
        return 0
    if choice == "xqa" and not served:
        raise ValueError(
            "kernels.fp8_decode_kernel='xqa' needs a Hopper GPU (SM90), pages of "
            f"{', '.join(map(str, PAGE_SIZES))} tokens and head_dim <= 256"
        )
    programs = xqa_programs(batch_size, gpu_name)
    if choice == "xqa":
        programs = programs or DEFAULT_PROGRAMS
    return num_splits(batch_size, num_kv_heads, programs) if programs and served else 0


class XQABuffers:
    """What the XQA launches of every captured batch size share (one graph runs at a time): the
    dense page table `[max_batch, pages per sequence]`, the lengths, semaphores, scratch."""

    def __init__(self, max_batch: int, max_pages_per_seq: int, device: torch.device) -> None:
        self.block_table = torch.zeros(
            (max_batch, max_pages_per_seq), dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones((max_batch, 1), dtype=torch.int32, device=device)
        self.semaphores = torch.zeros(_SEMAPHORE_BYTES // 4, dtype=torch.int32, device=device)
        self.scratch = torch.zeros(_SCRATCH_BYTES, dtype=torch.uint8, device=device)


class XQADecode:
    """XQA for decode steps of exactly `batch_size` rows, over fixed buffers: `plan` copies a
    step's page table and lengths in; `forward` may be captured in a CUDA graph."""

    def __init__(
        self, batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        page_size: int, dtype: torch.dtype, buffers: XQABuffers, splits: int,
    ) -> None:  # fmt: skip
        """`dtype`: q's and the output's (bf16 or fp16); `splits`: of each sequence."""
        from flashinfer.xqa import get_xqa_module

        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.page_size = page_size
        self.block_table = buffers.block_table[:batch_size]
        self.seq_lens = buffers.seq_lens[:batch_size]
        self.buffers = buffers
        self.sm_count = _sm_count_for(splits, batch_size, num_kv_heads)
        group = num_q_heads // num_kv_heads
        fp8 = torch.float8_e4m3fn
        self._module = get_xqa_module(dtype, fp8, page_size, head_dim, group, False, dtype, 1)
        self._pdl = pdl.enabled(buffers.block_table.device)

    def plan(self, page_table: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """A step's `[batch, pages]` page table (device) and its `[batch]` int32 lengths (host,
        pinned): copies, no wait."""
        self.block_table[:, : page_table.shape[1]].copy_(page_table, non_blocking=True)
        self.seq_lens[:, 0].copy_(kv_lens, non_blocking=True)

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, k_scale: float, v_scale: float
    ) -> torch.Tensor:
        """q `[B, Hq, D]` (rotated); `kv` one layer's FP8 pool `[pages, 2, page_size, Hkv, D]`
        holding every token attended to, as `stored = x / scale`. Returns `[B, Hq, D]`."""
        out = torch.empty_like(q)
        k, v = kv.unbind(1)
        # XQA scales Q.K by q_scale * kv_scale / sqrt(d) and the output by kv_scale.
        q_scale = self.scale * k_scale * math.sqrt(self.head_dim) / v_scale
        bufs = self.buffers
        self._module.xqa(
            True, self.sm_count, self.num_kv_heads, 0, q_scale, out.unsqueeze(1), 1.0,
            q.unsqueeze(1), None, k, v, None, None, self.block_table,
            self.block_table.shape[1] * self.page_size, self.seq_lens.view(torch.uint32),
            self.batch_size, v_scale, bufs.semaphores.view(torch.uint32), bufs.scratch,
            self._pdl, 1, None, None,
        )  # fmt: skip
        return out
