"""What a posted READ and the agent's counters look like to the engine loop."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any, Literal

XferState = Literal["DONE", "PROC", "ERR"]
XferKind = Literal["kv", "generations"]


def combine(states: list[XferState]) -> XferState:
    """One state for a read made of several reads (ranks, or a rank's sources): PROC while any
    is in flight (its pages may still be written), then ERR if any failed, else DONE."""
    if "PROC" in states:
        return "PROC"
    return "ERR" if "ERR" in states else "DONE"


@dataclass
class TransferStats:
    """Counters since start, for metrics. Transfers, bytes, descriptors and time count finished
    KV reads only (not generation reads); failures count both kinds."""

    num_transfers: int = 0
    num_failed_transfers: int = 0
    bytes_transferred: int = 0
    num_descriptors: int = 0
    xfer_time_s: float = 0.0
    post_time_s: float = 0.0
    num_notifs_sent: int = 0
    device_copies: int = 0  # KV reads from a peer on the same GPU, copied through CUDA IPC

    def __add__(self, other: TransferStats) -> TransferStats:
        """Counters of two agents together (the ranks of a TP engine)."""
        return TransferStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(eq=False)
class TransferHandle:
    """One posted READ. `state` is the last state `poll` saw; DONE and ERR are final.

    A generation READ (`kind == "generations"`) has its values in `generations` once DONE.
    """

    remote_agent: str
    kind: XferKind
    num_bytes: int
    num_descriptors: int
    posted_at: float = 0.0
    state: XferState = "PROC"
    finished_at: float | None = None
    generations: list[int] | None = None
    _xfer: Any = field(default=None, repr=False)
    _slot: int | None = field(default=None, repr=False)  # generation slot while in flight

    @property
    def xfer_time_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at
