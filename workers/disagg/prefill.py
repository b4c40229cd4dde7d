"""The prefill side of the hand-off: compute prompts, sample their first token, pin their KV.

After a sequence's first token it leaves the batch but keeps its pages: whole computed pages go
into the radix tree (locked by the sequence), the partial last page stays the sequence's own. A
lease holds it until the decode worker's read notification, `release_lease()`, or expiry.
With tensor parallelism the handle names every rank's agent (same page ids on each); rank 0's
agent alone gets the notification that releases a lease.

While no decode replica lives, the router sends whole requests here (`run_whole`): they stay in
the batch after their first token and decode to their end, as on a colocated engine; a stream
resumed here after its decode replica failed starts from the tokens already sent (`resume`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from workers.disagg.handoff import HandoffEngine
from workers.disagg.leases import Lease, LeaseTable
from workers.protocol import GenerateRequest, KVHandle, RequestOutput
from workers.sequence import Sequence

logger = logging.getLogger(__name__)

GROUP_DRAIN_S = 0.05


class PrefillEngine(HandoffEngine):
    role = "prefill"
    supports_overlap = False  # a prompt's first token ends its stay here: no step after it
    speculates = False  # nor a decode step to speculate in

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent.track_generations(self.allocator.generation)
        self.leases = LeaseTable()
        self.whole: set[str] = set()  # requests decoded here too: no hand-off
        self._next_drain = 0.0  # monotonic time of the next drain of ranks 1..N-1

    def run_whole(self, req: GenerateRequest, first: RequestOutput | None = None) -> Sequence:
        """Admit `req` to be decoded here to its end; with `first` (no KV handle), from the
        tokens a failed decode replica had streamed."""
        seq = self.add_request(req) if first is None else self.resume(req, first)
        self.whole.add(seq.request_id)
        return seq

    def _retire(self, seq: Sequence, cache: bool = True) -> None:
        self.whole.discard(seq.request_id)
        super()._retire(seq, cache)

    def _after_token(self, seq: Sequence) -> RequestOutput:
        if seq.finished or seq.request_id in self.whole:
            return super()._after_token(seq)
        self.scheduler.detach(seq)
        self.kv.cache_computed(seq)
        self.seqs.pop(seq.request_id, None)
        lease = Lease.new(seq, self.transfer.lease_s)
        self.leases.add(lease)
        out = self._output(seq)
        out.kv = self._handle(seq, lease)
        return out

    def _handle(self, seq: Sequence, lease: Lease) -> KVHandle:
        n = seq.num_prompt_tokens
        pages = seq.pages[: -(-n // self.cfg.page_size)]
        return KVHandle(
            agent_names=list(self.agent_names),  # one per TP rank: same page ids on each
            page_ids=pages,
            num_tokens=n,
            layout=list(self.kv_layouts),
            lease_id=lease.lease_id,
            lease_expiry=lease.expiry,
            page_generations=[int(self.allocator.generation[p]) for p in pages],
        )

    def lora_ids_in_use(self) -> set[int]:
        """Those of the requests here, and of the prompts pinned for a hand-off."""
        return super().lora_ids_in_use() | {x.seq.lora_id for x in self.leases if x.seq.lora_id}

    def release_lease(self, lease_id: str) -> bool:
        """Unpin a handed-off prompt (its full pages stay cached, unlocked)."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            return False
        self.kv.release(lease.seq, cache=True)
        return True

    def release_lease_of(self, agent_name: str, lease_id: str) -> None:
        """Unpin a lease held by `agent_name`: here, or by notifying that agent over NIXL (a
        caller cannot choose which prefill replica handles its call)."""
        if agent_name == self.agent.name:
            self.release_lease(lease_id)
        else:
            self.agent.send_notif(agent_name, lease_id.encode())

    def abort(self, request_id: str) -> RequestOutput | None:
        lease = self.leases.pop_request(request_id)
        if lease is not None:
            self.kv.release(lease.seq, cache=True)
            return None
        return super().abort(request_id)

    def poll(self) -> list[RequestOutput]:
        for msgs in self.agent.get_notifs().values():
            for msg in msgs:
                self.release_lease(msg.decode())
        for lease in self.leases.pop_expired():
            logger.warning("lease of %s expired unread: unpinning", lease.seq.request_id)
            self.kv.release(lease.seq, cache=True)
        if self.group is not None and len(self.leases) and time.monotonic() >= self._next_drain:
            # Ranks 1..N-1's agents progress only inside their calls: let readers of their
            # pages through. A reader needs that only to wire up its first READ of a rank (no
            # notification goes to ranks 1..N-1: leases are rank 0's business), so a command
            # round every GROUP_DRAIN_S, not every 1 ms poll: with a lease out and nothing to
            # step, each rank of a TP-2 group on a CPU host was 37% busy, now 7% / 4%.
            self.group.sync(drain_notifs=True)
            self._next_drain = time.monotonic() + GROUP_DRAIN_S
        return []

    def _pinned_own_pages(self) -> int:
        return sum(len(lease.seq.pages) - lease.seq.num_tree_pages for lease in self.leases)

    def _num_handoffs_pending(self) -> int:
        return len(self.leases)

    def idle_wait_s(self) -> float:
        # With NIXL's progress thread off, a peer's READ advances only when this agent polls.
        return 0.001 if len(self.leases) else super().idle_wait_s()
