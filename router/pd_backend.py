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
from there, so the client's stream neither repeats nor skips a token. Every wait is bounded;
past `attempts` re-sends or `deadline_s`, the request ends with a 503.
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
from router.failover import FailoverPolicy, Progress, Retries, is_replica_failure
from router.routing.dead_replicas import DeadReplicas
from router.routing.disagg import DecodeCacheView, prefill_remotely
from workers.api import GenerateRequest, RequestOutput, read_pool

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0  # the most /metrics waits for one pool's stats


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
        self.decode_stats = decode
        # conditional disaggregation (router.routing.disagg); set by the app
        self.decode_cache: DecodeCacheView | None = None
        self.prefill_queue_max_requests = 0
        self.prefills_waiting = 0

    def _prefill_remotely(self, req: GenerateRequest) -> bool:
        if self.prefill is None:
            return False
        prompt = req.prompt_token_ids
        cache = self.decode_cache
        uncached = len(prompt) if cache is None else cache.uncached_tokens(prompt)
        return prefill_remotely(uncached, self.prefills_waiting, self.decode_prefill_max_tokens,
                                self.prefill_queue_max_requests)  # fmt: skip

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        retries = Retries(self.failover)
        sent = Progress(req.request_id)
        first = None
        if self._prefill_remotely(req):
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
                # no decode replica took the pages: unpin them now
                kv = first.kv
                assert self.prefill is not None
                release = own_call(self.prefill.release, kv.agent_names[0], kv.lease_id)
                await asyncio.shield(asyncio.ensure_future(_quietly(release)))

    async def _prefill(self, req: GenerateRequest, retries: Retries) -> RequestOutput | None:
        """The prefill replica's first chunk; None once two replicas failed (decode prefills)."""
        assert self.prefill is not None
        for _ in range(2):
            response = own_call(
                self.prefill.prefill,
                req.model_copy(update={"request_id": retries.retry_id(req.request_id)}),
            )
            try:
                async with asyncio.timeout(retries.timeout_s()):
                    first: RequestOutput = await response
            except BaseException as e:
                response.cancel()  # a stalled replica lets go of it
                if not isinstance(e, Exception) or not is_replica_failure(e):
                    raise
                self._skip_if_dead("prefill", e)
                retries.failed("prefill", e)
            else:
                return first
        return None

    async def _decode(
        self, req: GenerateRequest, first: RequestOutput | None, sent: Progress, retries: Retries
    ) -> AsyncIterator[RequestOutput]:
        """The decode replica's chunks; after a failure, another's from where the client is."""
        resume, request_id = first, req.request_id
        while True:
            if resume is None:
                stream = own_call(self.decode.generate, req)
            else:
                stream = own_call(self.decode.generate, req, resume)
            ended = False
            try:
                while True:
                    async with asyncio.timeout(retries.timeout_s()):
                        chunk = await anext(stream, None)
                    if chunk is None:
                        ended = True
                        return
                    sent.add(chunk)
                    yield chunk
                    if chunk.finished:  # whole, whatever befalls the replica before its end
                        ended = True
                        return
            except Exception as e:
                if not is_replica_failure(e):
                    raise
                self._skip_if_dead("decode", e)
                retries.failed("decode", e)
            finally:
                if not ended:  # failed, or closed by the caller: the replica aborts it
                    stream.cancel()
            if first is not None and first.kv is not None and not sent.decoded:
                resume = first  # the pages were not read yet: the next replica reads them
            else:
                resume = sent.resume_point()
            params = req.params
            if sent.token_ids:  # the prompt's logprobs went out with the first token
                params = params.model_copy(update={"prompt_logprobs": None})
            req = req.model_copy(
                update={"request_id": retries.retry_id(request_id), "params": params}
            )

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
