"""FlashInfer's page table in CSR form: sequence i's pages are
`kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, the last one holding `last_page_len[i]` tokens.
`paged_metadata` derives that form from an `AttentionBatch`: the small per-sequence arrays on the
host (pinned; FlashInfer's planner reads them there), the page ids gathered on the device from the
batch's page table, so planning never waits on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.base import AttentionBatch
from workers.kernels.host_staging import host_array, to_device


@dataclass
class PagedMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32, host
    kv_indptr: torch.Tensor  # [B+1] int32, host
    last_page_len: torch.Tensor  # [B] int32, host, in [1, page_size]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the pool's device


def paged_metadata(batch: AttentionBatch, page_size: int) -> PagedMetadata:
    """CSR page table of `batch`. Invariant: sequence i's pages are its first
    `ceil(kv_lens[i] / page_size)` page-table entries, in order."""
    kv_lens = np.asarray(batch.kv_lens, dtype=np.int64)
    q_lens = np.asarray(batch.q_lens, dtype=np.int64)
    num_pages = -(-kv_lens // page_size)
    kv_indptr = np.zeros(len(kv_lens) + 1, dtype=np.int64)
    np.cumsum(num_pages, out=kv_indptr[1:])
    qo_indptr = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qo_indptr[1:])
    width = batch.page_table.shape[1]
    # Flat index of (row, j) for j < num_pages[row], rows in order.
    rows = np.repeat(np.arange(len(kv_lens)), num_pages)
    flat = rows * width + (np.arange(int(kv_indptr[-1])) - kv_indptr[rows])
    device = batch.page_table.device
    gather = to_device(flat, device)
    return PagedMetadata(
        qo_indptr=host_array(qo_indptr.astype(np.int32), device),
        kv_indptr=host_array(kv_indptr.astype(np.int32), device),
        last_page_len=host_array((kv_lens - (num_pages - 1) * page_size).astype(np.int32), device),
        kv_indices=batch.page_table.reshape(-1)[gather],
    )
