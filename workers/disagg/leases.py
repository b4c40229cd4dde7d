"""Leases: a prefill replica's pinned prompts awaiting their decode replica's read, by lease id.

A lease ends when the reader's NIXL notification arrives, on `release_lease()`, or at its expiry,
whichever comes first; its pages are unpinned then (`PrefillEngine`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from workers.sequence import Sequence


@dataclass
class Lease:
    lease_id: str
    seq: Sequence
    expiry: float  # unix time

    @classmethod
    def new(cls, seq: Sequence, lease_s: float) -> Lease:
        return cls(lease_id=uuid.uuid4().hex, seq=seq, expiry=time.time() + lease_s)


class LeaseTable:
    """Pinned prompts awaiting their decode worker, by lease id."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def add(self, lease: Lease) -> None:
        self._leases[lease.lease_id] = lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        expired = [lease for lease in self._leases.values() if lease.expiry <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        self.num_expired += len(expired)
        return expired

    def pop_request(self, request_id: str) -> Lease | None:
        for lease in self._leases.values():
            if lease.seq.request_id == request_id:
                return self._leases.pop(lease.lease_id)
        return None
