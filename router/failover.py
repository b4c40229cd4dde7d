"""Failover of the disaggregated backend: which failures are a replica's, each request's budget
of re-sends, and the point a stream resumed on another engine starts from.

A replica's failure is its actor dying or being unreachable (Ray's `RayActorError`), its engine
dying (`EngineDeadError`: a step failed, the replica is being replaced), Serve having no replica
to send to, silence past `replica_timeout_s` (a replica streaming to us sends a keepalive while
its engine loop runs, so only a stalled or dead one is silent), or its pool having no live
replica on the stats board while another pool could take the request (`NoLiveReplicaError`). A
request the engine rejects (`ValueError`, also when Ray wraps it) is the client's, never
retried; neither is an engine's error chunk (a request's own failure), which the client gets as
before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from router.errors import ServiceUnavailableError
from workers.api import EngineDeadError, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class NoLiveReplicaError(Exception):
    """The pool a request waits on has no live replica (stats board), and another pool has."""

    def __init__(self, pool: str) -> None:
        super().__init__(f"no live {pool} replica")


REPLICA_FAILURES = (
    RayActorError, DeploymentUnavailableError, ReplicaUnavailableError, TimeoutError,
    EngineDeadError, NoLiveReplicaError,
)  # fmt: skip


def is_replica_failure(exc: BaseException) -> bool:
    """Whether `exc` says a replica failed (worth a re-send), not that the request is bad."""
    seen: BaseException | None = exc
    for _ in range(8):  # a Ray task error names its cause; a chain is short
        if seen is None or isinstance(seen, ValueError):
            return False
        if isinstance(seen, REPLICA_FAILURES):
            return True
        seen = getattr(seen, "cause", None)
    return False


@dataclass(frozen=True)
class FailoverPolicy:
    """`RouterConfig`'s failover fields (cluster/config.py)."""

    attempts: int = 3
    deadline_s: float = 30.0
    replica_timeout_s: float = 60.0


class Retries:
    """One request's failover budget. A deadline bounds waits, never a stream:

    - after a failure, `deadline_s` bounds the wait until some replica takes the request (its
      first chunk or keepalive); every re-send of that wait falls within it;
    - at most `attempts` re-sends since the request's stream last made progress (a token sent to
      the client), so a request that kills every replica it reaches is not sent on for ever; a
      wait given up because its pool has no live replica is bounded by the deadline only;
    - a replica that has taken the request is waited on for `replica_timeout_s` of silence, for
      as long as it keeps streaming.
    """

    def __init__(self, policy: FailoverPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self.sends = 0  # re-sends so far: each gets an engine request id of its own
        self.strikes = 0  # failures since the last progress
        self.deadline: float | None = None  # set while no replica has taken a re-send

    def timeout_s(self) -> float:
        """The bound on the next wait for a replica's message."""
        if self.deadline is None:
            return self.policy.replica_timeout_s
        return max(0.0, min(self.policy.replica_timeout_s, self.deadline - self.clock()))

    def answered(self) -> None:
        """A replica has taken the request (it sent a chunk or a keepalive)."""
        self.deadline = None

    def progressed(self) -> None:
        """A token reached the client: the budget starts afresh."""
        self.deadline = None
        self.strikes = 0

    def failed(self, pool: str, exc: BaseException, counts: bool = True) -> None:
        """Count a failure of a `pool` replica (`counts` False: no replica failed, the pool had
        none live); raise `ServiceUnavailableError` (503, no Ray internals in its message) when
        no re-send may follow."""
        now = self.clock()
        if self.deadline is None:
            self.deadline = now + self.policy.deadline_s
        self.sends += 1
        self.strikes += counts
        out_of_budget = self.strikes > self.policy.attempts or now >= self.deadline
        logger.warning(
            "a %s replica failed (%s: %s); %s", pool, type(exc).__name__, str(exc)[:200],
            "giving up" if out_of_budget else f"re-send {self.strikes} of {self.policy.attempts}",
        )  # fmt: skip
        if out_of_budget:
            raise ServiceUnavailableError(
                f"no {pool} replica could serve the request in time; try again later"
            ) from exc

    def retry_id(self, request_id: str) -> str:
        """A fresh engine request id per re-send: a stalled replica may still hold the old one."""
        return request_id if not self.sends else f"{request_id}-retry{self.sends}"


@dataclass
class Progress:
    """What the client has been sent of one request, to resume its stream from."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    decoded: bool = False  # a decode replica has sent a chunk (so it has read the prompt's KV)

    def add(self, chunk: RequestOutput, decoded: bool = True) -> None:
        self.token_ids += chunk.token_ids
        self.text.append(chunk.text)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = chunk.num_cached_tokens
        self.decoded = self.decoded or decoded

    def resume_point(self) -> RequestOutput | None:
        """The chunk an engine resumes from (`HandoffEngine.resume`: a decode replica, or the
        prefill replica while no decode replica lives): every token sent, the text sent; None
        when nothing was sent (start over)."""
        if not self.token_ids:
            return None
        return RequestOutput(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            text="".join(self.text),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )
