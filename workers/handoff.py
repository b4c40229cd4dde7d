"""KV hand-off policy shared by both sides: leases on the prefill side, failure policy on decode.

Protocol (pull, DESIGN.md "One request"):
1. The prefill engine computes the prompt, samples the first token and pins the prompt's pages
   under a lease; the first chunk carries a `KVHandle` naming them.
2. The decode engine allocates local pages for what its own prefix cache lacks and READs the rest
   from the prefill agent. NIXL delivers the lease id to the prefill agent when the read is done.
3. The prefill engine unpins on that notification, on `release_lease()`, or when the lease
   expires, whichever comes first. The decode engine trusts a read only if the pages' generation
   numbers, read after the data, still equal those in the handle (no free/reuse in between).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.config import EngineConfig
from workers.engine_core import Engine
from workers.protocol import KVLayout
from workers.sequence import Sequence
from workers.tp import SINGLE, TPGroup
from workers.tp_runner import TPDriverRunner
from workers.transfer import KVTransferAgent
from workers.transfer.group import GroupTransfer


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_s: float = Field(30.0, gt=0, description="prefill pages stay pinned at most this long")
    transfer_timeout_s: float = Field(10.0, gt=0, description="a READ not done by then failed")
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="on a failed or stale transfer: prefill locally, or fail"
    )


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


class HandoffEngine(Engine):
    """An engine with a NIXL agent over its KV pool: the common part of both sides.

    With tensor_parallel_size N > 1 every rank has its own agent over its own pool: rank 0's is
    `agent`, ranks 1..N-1's are driven through `group` (workers/transfer/group.py), and
    `agent_names` / `kv_layouts` list all N in rank order. At N == 1 `group` is None.
    """

    role: str

    def __init__(
        self,
        cfg: EngineConfig,
        transfer: KVTransferConfig,
        replica_tag: str | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__(cfg, tp)
        self.transfer = transfer
        tag = replica_tag or uuid.uuid4().hex[:8]
        self.agent = KVTransferAgent(self.runner.pool, self.role, tag, tp.rank)
        self.group: GroupTransfer | None = None
        self.agent_names: list[str] = [self.agent.name]
        self.kv_layouts: list[KVLayout] = [self.agent.layout]
        if isinstance(self.runner, TPDriverRunner):
            self.group = GroupTransfer(self.runner, self.role, tag)
            self.agent_names += self.group.agent_names
            self.kv_layouts += self.group.layouts
