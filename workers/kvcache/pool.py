"""The KV page pool: one pre-allocated tensor per worker rank.

Layout `[num_pages, num_layers, 2, page_size, num_kv_heads, row_width]` (`row_width` is head_dim,
plus 4 bytes of scale in an int8 pool, `int8_rows.py`): page p holds every
layer's K and V for `page_size` token slots, contiguous in memory. A run of consecutive page ids
is therefore one contiguous byte range, which NIXL moves as one descriptor (DESIGN.md, KV pool).
A layer's view `[num_pages, 2, page_size, heads, dim]` has a strided page dimension, which the
torch backend indexes directly and FlashInfer's paged kernels accept as NHD layout.

An FP8 pool (`kv_dtype.py`) stores K and V scaled by `scales` and computes in `compute_dtype`
(the model's): K/V arrive and attention reads in that dtype.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from workers.kvcache.kv_dtype import KVScales, is_fp8
from workers.protocol import KVLayout

logger = logging.getLogger(__name__)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU an anonymous memory map, whose pages the kernel zeroes when
    first touched, so a CPU engine's pool (1 GiB by default) costs nothing at start
    (`torch.zeros` writes every byte: ~0.5 s a GiB) and only the memory its KV fills."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


class KVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
        scales: KVScales | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.pages = zeroed(
            (
                num_pages,
                layout.num_layers,
                2,
                layout.page_size,
                layout.num_kv_heads,
                layout.row_width,
            ),
            getattr(torch, layout.dtype),
            torch.device(device),
        )
        self.compute_dtype = compute_dtype or self.pages.dtype
        self.scales = scales or KVScales.unit(layout.num_layers)
        logger.info(
            "KV pool: %d pages x %d tokens, %.1f MiB of %s on %s: %d tokens fit",
            num_pages,
            layout.page_size,
            self.nbytes / 2**20,
            layout.dtype,
            self.pages.device,
            self.num_tokens,
        )

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_tokens(self) -> int:
        """KV tokens the pool holds, the scratch page left out."""
        return (self.num_pages - 1) * self.layout.page_size

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.pages.dtype)

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def layer(self, layer_id: int) -> torch.Tensor:
        """`[num_pages, 2, page_size, num_kv_heads, row_width]`, page dimension strided."""
        return self.pages[:, layer_id]

    def page_address(self, page_id: int) -> int:
        return self.pages.data_ptr() + page_id * self.layout.page_bytes
