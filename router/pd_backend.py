"""The disaggregated backend: prefill on one pool, then decode on another, streamed as one.

1. `prefill.prefill(req)` computes the prompt on a prefill replica and returns the first chunk
   (the first token, which is streamed at once: that is TTFT) with a `KVHandle`.
2. `decode.generate(req, first)` pulls the prompt's pages over NIXL on a decode replica and
   streams the remaining tokens.
If the client goes away between the two, the prefill replica is told to unpin the prompt's pages
at once instead of waiting for the lease to expire.

A prompt with at most `decode_prefill_max_tokens` tokens to compute skips step 1: its decode
replica prefills it in its own steps (as in colocated mode); so does any prompt while
`prefill_queue_max_requests` of this router's prompts wait on the prefill pool
(`router.routing.disagg`). Tokens to compute are those the best-placed decode replica does not
cache, from the decode pool's KV events (`decode_cache`), else the whole prompt. The running
batch's next step waits for that short prefill; the request is spared a second replica's queue,
the hop and the KV transfer. Which weighs more depends on the hardware (docs/notes/serving.md:
no gain on CPU).

Failover (`router.failover`; docs/architecture.md, "Failure handling"): a prefill whose replica
fails is sent once more to the pool, then prefilled by the decode replica. A decode replica that
fails before its first chunk is replaced by another reading the same KV handle; one that fails
mid-stream, by another that prefills the prompt and every token already streamed and goes on
from there, so the client's stream neither repeats nor skips a token. A pool with no live
replica on the stats board (`router.liveness`) is not waited for while the other can serve: a
decode replica prefills, or the prefill replica decodes (whole requests, and resumed streams
from the same resume point). A replica streaming to us sends keepalives while its engine runs,
so a busy one is never taken for a dead one. Every wait is bounded; past `attempts` re-sends
without progress, or `deadline_s` without a replica taking the request, it ends with a 503.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray.serve import context as serve_context

from router.backend import RoleStats
from router.failover import (
    FailoverPolicy,
    NoLiveReplicaError,
    Progress,
    Retries,
    is_replica_failure,
)  # fmt: skip
from router.liveness import PoolLiveness
from router.routing.dead_replicas import DeadReplicas
from router.routing.disagg import DecodeCacheView, prefill_remotely
from router.routing.policy import cache_ids
from workers.api import GenerateRequest, RequestOutput, read_pool

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0  # the most /metrics waits for one pool's stats
LIVENESS_POLL_S = 1.0  # how often a wait for a replica to take a request checks the board


class DisaggregatedBackend:
    def __init__(
        self, prefill: Any | None, decode: Any, app_name: str | None = None,
        decode_prefill_max_tokens: int = 0, failover: FailoverPolicy | None = None,
    ) -> None:  # fmt: skip
        """`prefill` / `decode`: Serve DeploymentHandles of the two pools; without a prefill
        pool (colocated mode) decode replicas serve whole requests, as they serve prompts of
        at most `decode_prefill_max_tokens` tokens. `app_name` finds every replica's posted
        stats (`workers/serve/stats_board.py`)."""
        self.app_name = app_name
        self.prefill = prefill
        self.decode_prefill_max_tokens = decode_prefill_max_tokens
        self.failover = failover or FailoverPolicy()
        self.decode = decode.options(stream=True)
        self.prefill_stream: Any = prefill and prefill.options(stream=True)
        self.live = PoolLiveness(app_name)
        self.decode_stats = decode
        # conditional disaggregation (router.routing.disagg); set by the app
        self.decode_cache: DecodeCacheView | None = None
        self.prefill_queue_max_requests = 0
        self.prefills_waiting = 0

    async def _prefill_remotely(self, req: GenerateRequest) -> bool:
        if self.prefill is None:
            return False
        if await self.live.down("prefill") or await self.live.down("decode"):
            return False  # a decode replica prefills, or the prefill replica runs it whole
        prompt = cache_ids(req)  # the decode caches' names of its pages (by adapter)
        cache = self.decode_cache
        uncached = len(prompt) if cache is None else cache.uncached_tokens(prompt)
        return prefill_remotely(uncached, self.prefills_waiting, self.decode_prefill_max_tokens,
                                self.prefill_queue_max_requests)  # fmt: skip

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        retries = Retries(self.failover)
        sent = Progress(req.request_id)
        first = None
        if await self._prefill_remotely(req):
            self.prefills_waiting += 1
            try:
                first = await self._prefill(req, retries)
            finally:
                self.prefills_waiting -= 1
        if first is not None:
            out = first.model_copy(update={"kv": None})
            sent.add(out, decoded=False)
            yield out
            if first.finished or first.kv is None:
                return
        try:
            async for chunk in self._decode(req, first, sent, retries):
                yield chunk
        finally:
            if first is not None and first.kv is not None and not sent.decoded:
                await self._release(first.kv)  # no decode replica took the pages: unpin them

    async def _prefill(self, req: GenerateRequest, retries: Retries) -> RequestOutput | None:
        """The prefill replica's first chunk; None once two replicas failed, or the pool has
        no live replica (decode prefills)."""
        assert self.prefill is not None
        for _ in range(2):
            if await self.live.down("prefill"):
                return None
            response = own_call(
                self.prefill.prefill,
                req.model_copy(update={"request_id": retries.retry_id(req.request_id)}),
            )
            try:
                first: RequestOutput = await self._answer(response, "prefill", retries)
            except BaseException as e:
                response.cancel()  # a stalled replica lets go of it
                if not isinstance(e, Exception) or not is_replica_failure(e):
                    raise
                self._skip_if_dead("prefill", e)
                retries.failed("prefill", e, counts=not isinstance(e, NoLiveReplicaError))
            else:
                retries.progressed()
                return first
        return None

    async def _answer(self, waited: Any, pool: str, retries: Retries) -> Any:
        """`await waited` (a replica's answer), within `retries.timeout_s()`. Until it comes,
        the board is checked every `LIVENESS_POLL_S`: if `pool` has no live replica left while
        the other pool has, `NoLiveReplicaError` (the caller sends the request there)."""

        async def wait() -> Any:
            return await waited

        task = asyncio.ensure_future(wait())
        try:
            async with asyncio.timeout(retries.timeout_s()):
                while True:
                    done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                    if done:
                        return task.result()
                    if await self._better_elsewhere(pool):
                        raise NoLiveReplicaError(pool)
        finally:
            if not task.done():
                task.cancel()  # a Serve call cancelled raises its own error: retrieve it
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _better_elsewhere(self, pool: str) -> bool:
        """Whether `pool` has no live replica and the other pool has one."""
        if self.prefill is None or not await self.live.down(pool):
            return False
        return not await self.live.down("decode" if pool == "prefill" else "prefill")

    async def _decode(
        self, req: GenerateRequest, first: RequestOutput | None, sent: Progress, retries: Retries
    ) -> AsyncIterator[RequestOutput]:
        """The decode replica's chunks; after a failure, another's from where the client is. With
        no live decode replica, the prefill replica runs the request (from the same point)."""
        resume, request_id = first, req.request_id
        lease = None if first is None else first.kv  # pinned until read or released
        while True:
            pool = "decode"
            if self.prefill is not None and await self._better_elsewhere("decode"):
                pool = "prefill"
                if lease is not None:  # unread: it prefills the prompt from its own cache
                    await self._release(lease)
                    lease, resume = None, sent.resume_point()
            handle = self.prefill_stream if pool == "prefill" else self.decode
            args = (req,) if resume is None else (req, resume)
            stream = own_call(handle.generate, *args)
            ended = False
            try:
                while True:
                    chunk = await self._answer(anext(stream, None), pool, retries)
                    if chunk is None:
                        ended = True
                        return
                    retries.answered()
                    if chunk.is_keepalive:  # the replica's engine runs: not silent
                        continue
                    retries.progressed()
                    sent.add(chunk)
                    yield chunk
                    if chunk.finished:  # whole, whatever befalls the replica before its end
                        ended = True
                        return
            except Exception as e:
                if not is_replica_failure(e):
                    raise
                self._skip_if_dead(pool, e)
                retries.failed(pool, e, counts=not isinstance(e, NoLiveReplicaError))
            finally:
                if not ended:  # failed, or closed by the caller: the replica aborts it
                    stream.cancel()
                if sent.decoded:
                    lease = None  # read by the replica that sent a chunk
            if lease is None:
                resume = sent.resume_point()  # else the pages were not read: the next one reads
            params = req.params
            if sent.token_ids:  # the prompt's logprobs went out with the first token
                params = params.model_copy(update={"prompt_logprobs": None})
            req = req.model_copy(
                update={"request_id": retries.retry_id(request_id), "params": params}
            )

    async def _release(self, kv: Any) -> None:
        """Unpin a prompt's pages no decode replica will read (best effort: leases expire)."""
        assert self.prefill is not None
        release = own_call(self.prefill.release, kv.agent_names[0], kv.lease_id)
        await asyncio.shield(asyncio.ensure_future(_quietly(release)))

    def _skip_if_dead(self, pool: str, exc: BaseException) -> None:
        """A replica whose engine died (`exc` says which) gets no re-send of this process's:
        its pool's request routers skip it from now on (`router.routing.dead_replicas`)."""
        if self.app_name is not None:
            DeadReplicas.of(self.app_name, pool).mark(exc)

    async def stats(self) -> list[RoleStats]:
        """Every replica's last posted snapshot, dead ones' not `live` (their counters stay in
        the totals); a pool none of whose replicas has posted yet is asked through its handle
        (one replica). Each wait is bounded by `STATS_TIMEOUT_S`: a pool without a replica
        renders what is known."""
        pools = [("decode", self.decode_stats)]
        if self.prefill is not None:
            pools.insert(0, ("prefill", self.prefill))
        out: list[RoleStats] = []
        for role, handle in pools:
            name = role if self.prefill is not None else "colocated"
            posted: list[Any] = []  # `Posted` entries
            if self.app_name is not None:
                read = asyncio.to_thread(read_pool, self.app_name, role)
                posted = await _within(read, f"reading the {role} pool's stats") or []
            out += [RoleStats(name, p.stats, p.live) for p in posted]
            if not posted:
                response = own_call(handle.stats)
                stats = await _within(response, f"asking a {role} replica for its stats")
                if stats is None:
                    response.cancel()
                else:
                    out.append(RoleStats(name, stats))
        return out


def own_call(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` (a Serve handle's method) as a Serve request of its own.

    A call made while serving an HTTP request inherits that request's internal id, and the
    request routers of `router.routing.serve_routers` rely on it twice: Serve hands the replica
    they chose to the pending call of that id, and their policies count work in flight by it.
    The choices of one request (`n`, prompt lists) are routed at the same moment; under one
    shared id only the first was ever handed a replica and the others waited for ever. So each
    call gets a fresh id (the client's `request_id`, used in logs, stays). A call is cancelled
    by cancelling what awaits it, which the router always does (`merge_streams`)."""
    ctx = contextvars.copy_context()
    return ctx.run(_remote_with_own_id, method, args)


def _remote_with_own_id(method: Any, args: tuple[Any, ...]) -> Any:
    # Serve reads its request context when `remote()` is called, in this copied context.
    current = serve_context._get_serve_request_context()
    own = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    serve_context._serve_request_context.set(own)  # type: ignore[arg-type]  # declared None
    return method.remote(*args)


async def _within(waited: Any, what: str) -> Any:
    """`await waited`, or None (logged) past `STATS_TIMEOUT_S` or on a failure."""
    try:
        return await asyncio.wait_for(waited, STATS_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - /metrics renders what it has
        logger.warning("%s failed: %r", what, e)
        return None


async def _quietly(response: Any) -> None:
    try:
        await response
    except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
        logger.warning("releasing a prefill lease failed: %r", e)
