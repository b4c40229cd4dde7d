"""KV transfers of a tensor-parallel engine: every rank moves its own KV heads.

Each rank of a TP engine holds the KV heads of its shard in its own pool, so each rank has its
own NIXL agent (named with its rank, published in Ray KV like rank 0's). Each decode rank reads
its own heads (`kv_read.KVRead`): with equal TP on both sides the pages of prefill rank r, else
staged through spare pages. Page ids are the same on every rank of a group (every rank's pool has
the same size and rank 0 allocates for all), so one `ReadSpec` serves every rank.

Rank 0 (the engine) drives: it makes its own reads in-process, and sends ranks 1..N-1 their part
as `TransferOps`, a `RankCommand` broadcast over the TP control group between steps, whose
answers (each rank's read states) are gathered back to rank 0. `GroupTransfer.sync()` makes at
most one such round and none when there is nothing to post, poll, release or drain. A TP=1
engine has no `GroupTransfer`: it sends nothing.

Each rank's agent is driven by one thread only (package docstring): rank 0's by the engine loop,
the others' by their rank's step loop, which runs the commands in the order rank 0 sent them,
between the steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from workers.engine.tp_runner import RankCommand, RankRunner, TPDriverRunner
from workers.protocol import KVLayout
from workers.transfer.agent import KVTransferAgent
from workers.transfer.errors import TransportUnavailableError
from workers.transfer.handle import TransferStats, XferState, combine
from workers.transfer.kv_read import KVRead, ReadSpec

logger = logging.getLogger(__name__)


@dataclass
class ReadPost:
    """One read, which every rank makes for its own heads."""

    read_id: int
    spec: ReadSpec


class RankTransfer:
    """The transfer state of one rank 1..N-1: its agent, its pool and its reads, by read id."""

    def __init__(self, agent: KVTransferAgent, pages: torch.Tensor, rank: int) -> None:
        self.agent = agent
        self.pages = pages
        self.rank = rank
        self.reads: dict[int, KVRead] = {}

    def apply(self, ops: TransferOps) -> dict[int, XferState]:
        """Releases first (their pages may be posted again in this round), then posts, then
        polls; the state of every read posted or polled."""
        for rid in ops.releases:
            read = self.reads.pop(rid, None)
            if read is not None:
                read.release()
        states: dict[int, XferState] = {}
        for post in ops.posts:
            try:
                self.reads[post.read_id] = KVRead(self.agent, self.pages, post.spec)
            except Exception as e:  # noqa: BLE001 - reported as ERR; rank 0 applies the policy
                logger.warning("TP rank %d: KV read not posted: %s", self.rank, e)
                states[post.read_id] = "ERR"
        for rid in [*(p.read_id for p in ops.posts), *ops.polls]:
            if rid not in states:
                read = self.reads.get(rid)
                states[rid] = "ERR" if read is None else read.poll()
        if ops.drain_notifs:
            self.agent.get_notifs()  # progresses UCX for peers reading this rank's pages
        return states


@dataclass
class RankAnswer:
    """A rank's reply to `TransferOps`: its reads' states and its agent's counters."""

    states: dict[int, XferState]
    stats: TransferStats | None = None


@dataclass
class StartAgents(RankCommand):
    """Create each rank's agent over its pool; answers (agent name, layout) or the error."""

    role: str
    replica_tag: str
    device_copy: bool = True

    def run(self, runner: RankRunner) -> tuple[str, KVLayout] | str:
        rank = runner.tp.rank
        try:
            agent = KVTransferAgent(
                runner.pool, self.role, self.replica_tag, rank, device_copy=self.device_copy
            )
        except Exception as e:  # noqa: BLE001 - rank 0 raises it
            return f"TP rank {rank}: {type(e).__name__}: {e}"
        runner.transfer = RankTransfer(agent, runner.pool.pages, rank)
        return agent.name, agent.layout


@dataclass
class TransferOps(RankCommand):
    posts: list[ReadPost] = field(default_factory=list)
    polls: list[int] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    drain_notifs: bool = False

    def run(self, runner: RankRunner) -> RankAnswer:
        transfer: RankTransfer | None = runner.transfer
        if transfer is None:  # no agent here: every read fails
            ids = [*(p.read_id for p in self.posts), *self.polls]
            return RankAnswer({rid: "ERR" for rid in ids})
        states = transfer.apply(self)
        return RankAnswer(states, transfer.agent.stats())  # after the polls: counts those done


class GroupTransfer:
    """Rank 0's side of ranks 1..N-1's transfers: queue posts and releases, keep each read's
    last known state on every rank, and `sync()` them in one command round."""

    def __init__(
        self, runner: TPDriverRunner, role: str, replica_tag: str, device_copy: bool = True
    ) -> None:
        answers = runner.command(StartAgents(role, replica_tag, device_copy))
        errors = [a for a in answers if isinstance(a, str)]
        if errors:
            raise TransportUnavailableError("; ".join(errors))
        self.agent_names: list[str] = [a[0] for a in answers]
        self.layouts: list[KVLayout] = [a[1] for a in answers]
        self._runner = runner
        self._num_ranks = len(answers)
        self._next_id = 0
        self._posts: list[ReadPost] = []
        self._releases: list[int] = []
        self._states: dict[int, list[XferState]] = {}
        self._rank_stats: list[TransferStats] = [TransferStats() for _ in answers]
        self.broken: str | None = None

    def post(self, spec: ReadSpec) -> int:
        """Queue a read on every rank 1..N-1 (sent at the next `sync`); its read id."""
        rid = self._next_id
        self._next_id += 1
        self._posts.append(ReadPost(rid, spec))
        self._states[rid] = ["PROC"] * self._num_ranks
        return rid

    def state(self, rid: int) -> XferState:
        """The combined state of read `rid` on ranks 1..N-1, as of the last `sync`."""
        states = self._states.get(rid)
        return "ERR" if states is None else combine(states)

    def release(self, rid: int) -> None:
        """Free read `rid` on every rank (cancelling it where still in flight), at the next
        `sync`, which comes before any step could write its pages again."""
        self._states.pop(rid, None)
        queued = [p for p in self._posts if p.read_id == rid]
        if queued:
            self._posts.remove(queued[0])
        else:
            self._releases.append(rid)

    def sync(self, drain_notifs: bool = False) -> None:
        """One command round: post, release, poll the reads in flight (and drain the ranks'
        notifications); nothing is sent when there is nothing to do."""
        posted = {p.read_id for p in self._posts}
        polls = [r for r, s in self._states.items() if "PROC" in s and r not in posted]
        if not (self._posts or self._releases or polls or drain_notifs):
            return
        ops = TransferOps(self._posts, polls, self._releases, drain_notifs)
        self._posts, self._releases = [], []
        if self.broken is None:
            try:
                answers = self._runner.command(ops)
            except Exception as e:  # noqa: BLE001 - the group is gone: every read failed
                logger.error("TP transfer command failed: %s", e)
                self.broken = str(e)
        if self.broken is not None:
            for states in self._states.values():
                states[:] = ["ERR"] * self._num_ranks
            return
        for r, answer in enumerate(answers):
            if answer.stats is not None:
                self._rank_stats[r] = answer.stats
            for rid, state in answer.states.items():
                if rid in self._states:
                    self._states[rid][r] = state

    def stats(self) -> TransferStats:
        """Ranks 1..N-1's agent counters summed, as of the last `sync` (reads move counters
        only while they are polled, and every poll is a sync)."""
        return sum(self._rank_stats, TransferStats())
