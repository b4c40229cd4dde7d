"""The host-memory tier's index: which page sits in which row of the host buffer (`TierData`)."""

from __future__ import annotations

from workers.kvcache.tiers.index import TierIndex


class HostTier(TierIndex):
    def __init__(self, capacity: int, page_bytes: int) -> None:
        if capacity < 1:
            raise ValueError(
                f"kv_offload.cpu_gb holds no page: a page is {page_bytes / 2**20:.2f} MiB"
            )
        super().__init__(capacity)
        # pop() gives the highest row first: `spill` takes rows deepest page first, so a prefix's
        # pages get ascending rows, which a load copies to ascending device pages in one piece
        self._free = list(range(capacity))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_slot(self, slot: int) -> None:
        self._free.append(slot)
