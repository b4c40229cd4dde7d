"""The host-memory tier: evicted KV pages in one pre-allocated byte buffer, a row a page.

On a GPU the buffer is pinned, so the copy engine moves pages both ways without staging; on the
CPU it is an anonymous memory map (`pool.zeroed`), which costs nothing until pages arrive.
"""

from __future__ import annotations

import torch

from workers.kvcache.pool import zeroed
from workers.kvcache.tiers.index import TierIndex


class HostTier(TierIndex):
    def __init__(self, capacity: int, page_bytes: int, pin: bool) -> None:
        if capacity < 1:
            raise ValueError(
                f"kv_offload.cpu_gb holds no page: a page is {page_bytes / 2**20:.2f} MiB"
            )
        super().__init__(capacity)
        if pin:
            self.data = torch.empty((capacity, page_bytes), dtype=torch.uint8, pin_memory=True)
        else:
            self.data = zeroed((capacity, page_bytes), torch.uint8, torch.device("cpu"))
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_slot(self, slot: int) -> None:
        self._free.append(slot)
