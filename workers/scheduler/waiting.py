"""The scheduler's queue of waiting sequences, in the order the scheduling policy admits them.

`fcfs` (the default, vLLM's too): arrival order; a sequence put back (preempted, or its pages
loaded from the KV tiers) goes to the head. `priority` (vLLM's `--scheduling-policy priority`):
by each request's `priority` (lower first), then arrival; a sequence put back takes its place by
the same key, which for the highest-priority one is the head as well.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from workers.config import SchedulingPolicy
from workers.sequence import Sequence


def admission_key(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: priority (lower first), then arrival."""
    return seq.priority, seq.arrival_time


class WaitingQueue:
    """Waiting sequences: `push` one that arrives, `push_back` one that was taken out before
    (preempted, loaded), `head` / `pop_head` the next to admit. One deque for both policies:
    the priority policy only inserts by `admission_key` where fcfs appends."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.by_priority = policy == "priority"
        self._seqs: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        if self.by_priority:
            bisect.insort(self._seqs, seq, key=admission_key)
        else:
            self._seqs.append(seq)

    def push_back(self, seq: Sequence) -> None:
        if self.by_priority:
            self.push(seq)  # its key's place: the head if it is the most urgent
        else:
            self._seqs.appendleft(seq)

    def head(self) -> Sequence:
        return self._seqs[0]

    def pop_head(self) -> Sequence:
        return self._seqs.popleft()

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)
