"""The decode side of the hand-off: pull a prompt's KV pages, then decode in the running batch.

A request arrives with its first token and the prefill side's `KVHandle`. Its life here:
  pending (waiting for local pages) -> reading (KV READ posted) -> checking (generation numbers
  READ after the data) -> running (joined the batch), or on failure -> recompute (prefilled here
  from scratch, the default) / failed (error chunk), per `KVTransferConfig.failure_policy`.
Pages already in this replica's prefix cache are not read again (delta transfer). An aborted
request keeps its pages until its in-flight read ends, since NIXL may still be writing them.

Tensor parallelism: each rank reads its own KV heads (`transfer.kv_read`): from prefill rank r
with equal TP on both sides; otherwise, from the prefill ranks holding its heads, staged through
spare pages of its pool that rank 0 allocates for the read and frees when it ends (heterogeneous
TP: any two TP degrees that split the model's KV heads). Rank 0 posts its own read, then ranks
1..N-1's through `self.group` (one command round per `poll`, after rank 0's own work); a read is
DONE when every rank's is, PROC while any rank's is in flight, ERR (then the failure policy) once
none is in flight and one failed. The generation check reads prefill rank 0's counters only:
every rank's pages are allocated by its rank 0. A prompt whose whole pages this replica already
caches is not read at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from workers.disagg.handoff import HandoffEngine
from workers.engine.engine import RequestRejectedError
from workers.engine_stats import EngineStats
from workers.protocol import GenerateRequest, KVHandle, RequestOutput
from workers.sequence import SeqStatus, Sequence
from workers.transfer import KVLayoutMismatchError, TransferError, TransferHandle, XferState
from workers.transfer.handle import combine
from workers.transfer.head_slices import head_sources, staging_pages_needed
from workers.transfer.kv_read import KVRead, ReadSpec

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingRead:
    seq: Sequence
    kv: KVHandle
    deadline: float
    read: KVRead | None = None  # rank 0's part of the KV read
    group_read: int | None = None  # ranks 1..N-1's parts (TP only), by `group` read id
    spare_pages: list[int] = field(default_factory=list)  # staging (heterogeneous TP)
    check: TransferHandle | None = None  # the generations' READ, once the KV is here
    start_after: float | None = None  # monotonic time an injected delay lets the read start
    aborted: bool = False

    @property
    def started(self) -> bool:
        return self.read is not None or self.check is not None


class DecodeEngine(HandoffEngine):
    role = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[PendingRead] = []
        self.pages_read = 0
        self.pages_reused = 0  # prompt pages found in this replica's prefix cache
        self.num_recomputed = 0

    def add_remote(self, req: GenerateRequest, first: RequestOutput) -> Sequence:
        """Admit a request begun elsewhere: `first` holds its output so far. With a KV handle
        (a prefill replica's first chunk: one token) the prompt's pages are read over NIXL;
        without one (a stream resumed after its decode replica failed: every token streamed)
        the prompt and those tokens are prefilled here, from the prefix cache where it can."""
        if first.kv is None:
            return self.resume(req, first)
        if len(first.token_ids) != 1:
            raise RequestRejectedError("a decode request needs the first token and a KV handle")
        if len(first.kv.agent_names) != len(first.kv.layout):
            raise RequestRejectedError("the KV handle needs one layout per prefill rank")
        try:
            for layout in self.kv_layouts:
                head_sources(layout, first.kv.layout)
        except KVLayoutMismatchError as e:
            raise RequestRejectedError(f"cannot read the prefill replica's KV: {e}") from e
        if first.kv.num_tokens != len(req.prompt_token_ids):
            raise RequestRejectedError("the KV handle does not cover the prompt")
        seq = self._continue(req, first)
        deadline = time.monotonic() + self.transfer.transfer_timeout_s
        self.pending.append(PendingRead(seq, first.kv, deadline))
        return seq

    def stats(self) -> EngineStats:
        t = self.agent.stats()
        if self.group is not None:  # every rank reads its own KV heads: count them all
            t = t + self.group.stats()
        return (
            super()
            .stats()
            .model_copy(
                update={
                    "nixl_bytes_transferred": t.bytes_transferred,
                    "nixl_transfers": t.num_transfers,
                    "nixl_xfer_time_s": t.xfer_time_s,
                    "kv_device_copies": t.device_copies,
                    "kv_pages_read": self.pages_read,
                    "kv_pages_reused": self.pages_reused,
                    "num_recomputed": self.num_recomputed,
                }
            )
        )

    def has_work(self) -> bool:
        return super().has_work() or bool(self.pending)

    def _num_handoffs_pending(self) -> int:
        return len(self.pending)

    def abort(self, request_id: str) -> RequestOutput | None:
        for p in self.pending:
            if p.seq.request_id == request_id and not p.aborted:
                p.aborted = True
                self.seqs.pop(request_id, None)
                p.seq.status, p.seq.finish_reason = SeqStatus.FINISHED, "abort"
                if not p.started:
                    self._drop(p)
                return self._output(p.seq)
        return super().abort(request_id)

    # ---- the loop thread's polling ---------------------------------------------------------
    def poll(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for p in list(self.pending):
            if not p.started:
                self._start_read(p, outputs)
                continue
            state = self._state(p)
            if state == "PROC" and time.monotonic() < p.deadline:
                continue
            checked = p.check is not None
            generations = p.check.generations if p.check is not None else None
            self._end_reads(p)
            if p.aborted:
                self._drop(p)
            elif state != "DONE":
                self._failed(p, f"KV read {'timed out' if state == 'PROC' else 'failed'}", outputs)
            elif not checked:
                self._start_check(p, outputs)
            else:
                self._finish_check(p, generations, outputs)
        if self.group is not None:
            self.group.sync()  # before any step: pages freed above are released on every rank
        return outputs

    def _start_read(self, p: PendingRead, outputs: list[RequestOutput]) -> None:
        seq, n = p.seq, p.kv.num_tokens
        if self.faults is not None and not self._injected(p, outputs):
            return
        if self.kv.start_onload(seq):
            return  # its cached pages come up from the KV tiers first: read at a later poll
        self.kv.match_prefix(seq)
        seq.num_computed_tokens = min(seq.num_computed_tokens, n)
        first = seq.num_tree_pages
        last = -(-n // self.cfg.page_size)
        staging = staging_pages_needed(self.kv_layouts, p.kv.layout, last - first)
        spare = None
        if self.kv.reserve(seq, n):  # the prompt's pages, then any to stage the read through
            spare = self.kv.allocate(staging)
        if spare is None:
            self.kv.release(seq, cache=False)  # no room yet: retry at the next poll
            if time.monotonic() >= p.deadline:
                self._failed(p, "no KV pages free for the transfer", outputs)
            return
        self.pages_reused += first
        if first == last:  # every page is cached here already
            self._admit(p, outputs)
            return
        p.spare_pages = spare
        spec = ReadSpec(
            list(p.kv.agent_names), list(p.kv.layout), p.kv.page_ids[first:last],
            seq.pages[first:last], spare,
        )  # fmt: skip
        try:
            p.read = KVRead(self.agent, self.runner.pool.pages, spec)
            if self.group is not None:  # after rank 0's post: a failed one leaves no rank's read
                p.group_read = self.group.post(spec)
            self.pages_read += last - first
        except (TransferError, ValueError) as e:
            self._failed(p, f"KV read could not start: {e}", outputs)

    def _injected(self, p: PendingRead, outputs: list[RequestOutput]) -> bool:
        """Whether `p`'s read may start now, under the faults injected into KV reads."""
        if p.start_after is None:
            assert self.faults is not None
            fault = self.faults.strike("kv_read", p.seq.token_ids[: p.seq.num_prompt_tokens])
            p.start_after = time.monotonic() + (fault.delay_s if fault is not None else 0.0)
            if fault is not None and fault.action == "fail":
                self._failed(p, "KV read failed (injected fault)", outputs)
                return False
        if time.monotonic() < p.start_after:
            if time.monotonic() >= p.deadline:
                self._failed(p, "KV read timed out (injected delay)", outputs)
            return False
        return True

    def _state(self, p: PendingRead) -> XferState:
        """The state of `p`'s generation check, or of its KV read on every rank."""
        if p.check is not None:
            return self.agent.poll(p.check)
        assert p.read is not None
        states = [p.read.poll()]
        if p.group_read is not None:
            assert self.group is not None
            states.append(self.group.state(p.group_read))
        return combine(states)

    def _end_reads(self, p: PendingRead) -> None:
        """Free `p`'s reads on every rank (cancelling any in flight) and its spare pages (ranks
        1..N-1 release theirs at the next sync, before any step or post could reuse them)."""
        if p.check is not None:
            self.agent.release(p.check)
            p.check = None
        if p.read is not None:
            p.read.release()
            p.read = None
        if p.group_read is not None:
            assert self.group is not None
            self.group.release(p.group_read)
            p.group_read = None
        if p.spare_pages:
            self.allocator.free(p.spare_pages)
            p.spare_pages = []

    def _start_check(self, p: PendingRead, outputs: list[RequestOutput]) -> None:
        """The data is here; read the pages' generations to prove they were not reused."""
        try:
            p.check = self.agent.read_generations(p.kv.agent_names[0], p.kv.page_ids)
        except TransferError as e:
            self._failed(p, f"generation check could not start: {e}", outputs)

    def _finish_check(
        self, p: PendingRead, generations: list[int] | None, outputs: list[RequestOutput]
    ) -> None:
        if generations != list(p.kv.page_generations):
            self._failed(p, "stale KV: prefill pages were reused before the read", outputs)
            return
        self._admit(p, outputs)

    def _admit(self, p: PendingRead, outputs: list[RequestOutput]) -> None:
        """`p`'s KV is all here: it joins the running batch, once its grammar (if any) is
        compiled; that began when the request came, so it is ready unless it failed."""
        self.pending.remove(p)
        self._notify(p)
        seq = p.seq
        ready = True if seq.constraint is None else seq.constraint.wait()
        if ready is not True:  # `_fail` frees its pages
            outputs.append(self._fail(seq, ready or "grammar compilation timed out"))
            return
        seq.num_computed_tokens = p.kv.num_tokens
        self.kv.cache_computed(seq)
        self.scheduler.add_running(seq)

    def _failed(self, p: PendingRead, why: str, outputs: list[RequestOutput]) -> None:
        if p in self.pending:
            self.pending.remove(p)
        self._end_reads(p)
        seq = p.seq
        self.kv.release(seq, cache=False)
        self._notify(p)
        if self.transfer.failure_policy == "recompute":
            logger.warning("%s: %s; recomputing the prompt here", seq.request_id, why)
            self.num_recomputed += 1
            self._enqueue(seq)
            return
        logger.warning("%s: %s; failing the request", seq.request_id, why)
        outputs.append(self._fail(seq, why))

    def _notify(self, p: PendingRead) -> None:
        """Tell the prefill agent it may unpin (best effort: a lease also expires by itself)."""
        try:
            self.agent.send_notif(p.kv.agent_names[0], p.kv.lease_id.encode())
        except TransferError as e:
            logger.warning("could not notify %s: %s", p.kv.agent_names[0], e)

    def _drop(self, p: PendingRead) -> None:
        if p in self.pending:
            self.pending.remove(p)
        self._end_reads(p)
        self.kv.release(p.seq, cache=False)
