"""Page generation numbers over NIXL: the stale-read check of the KV hand-off.

The prefill side registers its allocator's `generation` tensor (int64, one entry per page,
bumped when a page is freed) and publishes where it lies. After a decode worker's KV READ is
done, it READs the generations of the same pages; if they still equal those recorded in the
`KVHandle`, no page was freed and reused while it was being read.

Each generation READ lands in its own slot (a registered int64 buffer), held from posting until
the READ ends, so any number of checks can be in flight at once. Slots are registered when more
are needed than ever before, and reused afterwards.

Invariants:
- A slot is in use by at most one READ; it returns to the free list when its READ is DONE or
  ERR (values copied out first), or released without being cancelled-and-failed.
- A slot whose READ could not be cancelled is never reused (NIXL may still write it).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from workers.transfer.descriptors import PoolRegion

logger = logging.getLogger(__name__)

GEN_BYTES = 8  # int64


def generation_region(generation: torch.Tensor) -> PoolRegion:
    """Where a generation tensor lies, as a region of 8-byte "pages" (one per KV page)."""
    if generation.dtype != torch.int64 or generation.dim() != 1 or generation.is_cuda:
        raise ValueError("generation numbers must be a 1-D int64 CPU tensor")
    if not generation.is_contiguous():
        raise ValueError("the generation tensor must be contiguous to register it with NIXL")
    return PoolRegion(generation.data_ptr(), len(generation), GEN_BYTES, 0, "DRAM")


class GenerationSlots:
    """Registered int64 buffers, `slot_len` entries each, that generation READs land in."""

    def __init__(self, nixl_agent: Any, slot_len: int) -> None:
        self._nixl = nixl_agent
        self.slot_len = slot_len
        self._buffers: list[torch.Tensor] = []
        self._regs: list[Any] = []
        self._free: list[int] = []

    def acquire(self) -> int:
        if not self._free:
            buf = torch.zeros(self.slot_len, dtype=torch.int64)
            self._regs.append(self._nixl.register_memory(
                [(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM"
            ))
            self._buffers.append(buf)
            self._free.append(len(self._buffers) - 1)
            logger.debug("generation slots: %d registered", len(self._buffers))
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def region(self, slot: int) -> PoolRegion:
        return generation_region(self._buffers[slot])

    def values(self, slot: int, n: int) -> list[int]:
        return self._buffers[slot][:n].tolist()

    def local_pages(self, n: int) -> np.ndarray:
        """Entry i of a slot receives the generation of the i-th remote page."""
        if n > self.slot_len:
            raise ValueError(f"{n} pages exceed a generation slot ({self.slot_len} entries)")
        return np.arange(n, dtype=np.int64)

    def close(self) -> None:
        for reg in self._regs:
            self._nixl.deregister_memory(reg)
        self._buffers, self._regs, self._free = [], [], []
