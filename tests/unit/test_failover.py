"""The disaggregated backend's failover against fake pools: which failures are retried, that a
resumed stream neither repeats nor skips a token, that every wait is bounded while a stream that
makes progress is never cut by the deadline, that a pool without a live replica is skipped for
the other one, and that a request no replica could serve ends with a 503 and leaves no lease
pinned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from router import failover
from router.errors import ServiceUnavailableError
from router.failover import FailoverPolicy, Progress, Retries, is_replica_failure
from router.pd_backend import DisaggregatedBackend
from workers.api import GenerateRequest, KVHandle, RequestOutput, SamplingParams

PROMPT = (1, 2, 3)
MAX_TOKENS = 8
FAST = FailoverPolicy(attempts=3, deadline_s=5.0, replica_timeout_s=0.5)


def token(i: int) -> int:
    """The fake model's i-th output token (greedy: the same on every replica)."""
    return 100 + i


def handle_kv() -> KVHandle:
    return KVHandle(agent_names=["p0"], page_ids=[0], num_tokens=len(PROMPT), layout=[],
                    lease_id="lease", lease_expiry=0.0, page_generations=[0])  # fmt: skip


class Call:
    """A Serve handle call: awaitable (unary) or async-iterable (streaming), cancellable."""

    def __init__(self, make: Callable[[], Any], stream: bool) -> None:
        self.make, self.stream, self.cancelled = make, stream, False
        self._it: AsyncIterator[RequestOutput] | None = None

    def __await__(self):  # noqa: ANN204
        return self.make().__await__()

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._it is None:
            self._it = self.make()
        return await anext(self._it)

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    def __init__(self, fn: Callable[..., Any], stream: bool = False) -> None:
        self.fn, self.stream, self.calls = fn, stream, []

    def remote(self, *args: Any) -> Call:
        self.calls.append(args)
        return Call(lambda: self.fn(*args), self.stream)


class Handle:
    def __init__(self, **methods: Method) -> None:
        self.__dict__.update(methods)

    def options(self, **_: Any) -> Handle:
        return self


class Pools:
    """A prefill and a decode pool whose replicas fail on the scripts' orders: `prefill_fails`
    and `decode_fails` list, per call, None (serve) or how many chunks to send before dying
    (-1: hang). A decode stream waits `pause_s` before each chunk, sending a keepalive every
    `keepalive_s` meanwhile (0: none). The prefill pool's `generate` runs whole requests (the
    prefill replica decoding while no decode replica lives), with the decode pool's script."""

    def __init__(self, prefill_fails: list[int | None] = (), decode_fails: list[int | None] = (),
                 pause_s: float = 0.0, keepalive_s: float = 0.0):  # fmt: skip
        self.prefill_fails, self.decode_fails = list(prefill_fails), list(decode_fails)
        self.pause_s, self.keepalive_s = pause_s, keepalive_s
        self.released: list[str] = []
        self.prefill = Handle(prefill=Method(self._prefill), release=Method(self._release),
                              generate=Method(self._generate, stream=True))  # fmt: skip
        self.decode = Handle(generate=Method(self._generate, stream=True))

    async def _prefill(self, req: GenerateRequest) -> RequestOutput:
        fail = self.prefill_fails.pop(0) if self.prefill_fails else None
        if fail == -1:
            await asyncio.sleep(60)
        if fail is not None:
            raise ActorDiedError()
        return RequestOutput(request_id=req.request_id, token_ids=[token(0)], text="t0",
                             num_prompt_tokens=len(PROMPT), kv=handle_kv())  # fmt: skip

    async def _release(self, agent: str, lease_id: str) -> None:
        self.released.append(lease_id)

    async def _generate(
        self, req: GenerateRequest, first: RequestOutput | None = None
    ) -> AsyncIterator[RequestOutput]:
        fail = self.decode_fails.pop(0) if self.decode_fails else None
        start = 0 if first is None else len(first.token_ids)
        if first is not None and first.kv is None:  # resumed: text as streamed
            assert first.text == "".join(f"t{i}" for i in range(start))
        for sent, i in enumerate(range(start, req.params.max_tokens)):
            if fail == -1:
                await asyncio.sleep(60)
            waited = 0.0
            while waited < self.pause_s:  # busy: keepalives say the engine runs
                step = self.keepalive_s or self.pause_s
                await asyncio.sleep(step)
                waited += step
                if self.keepalive_s:
                    yield RequestOutput(request_id=req.request_id)
            if fail is not None and sent >= fail:
                raise ActorDiedError()
            done = i + 1 == req.params.max_tokens
            yield RequestOutput(request_id=req.request_id, token_ids=[token(i)], text=f"t{i}",
                                finish_reason="length" if done else None)  # fmt: skip
        if fail is not None:  # dies after its last chunk, before its stream ends
            raise ActorDiedError()


def request() -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=PROMPT,
                           params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0))  # fmt: skip


class Board:
    """The stats board's verdicts: the pools listed in `down` have no live replica."""

    def __init__(self, *down: str) -> None:
        self.down_pools = set(down)
        self.asked: list[str] = []

    async def down(self, pool: str) -> bool:
        self.asked.append(pool)
        return pool in self.down_pools


async def collect(
    pools: Pools, threshold: int = 0, policy: FailoverPolicy = FAST, board: Board | None = None
) -> list[RequestOutput]:
    backend = DisaggregatedBackend(pools.prefill, pools.decode, None, threshold, policy)
    if board is not None:
        backend.live = board  # type: ignore[assignment]  # a fake PoolLiveness
    return [c async for c in backend.generate(request())]


def check_whole(chunks: list[RequestOutput]) -> None:
    assert [t for c in chunks for t in c.token_ids] == [token(i) for i in range(MAX_TOKENS)]
    assert "".join(c.text for c in chunks) == "".join(f"t{i}" for i in range(MAX_TOKENS))
    assert chunks[-1].finish_reason == "length"
    assert all(c.kv is None for c in chunks)


def test_replica_failures_are_told_from_bad_requests() -> None:
    assert is_replica_failure(ActorDiedError())
    assert is_replica_failure(TimeoutError())
    wrapped = RayTaskError("generate", "tb", ActorDiedError())
    assert is_replica_failure(wrapped)
    rejected = RayTaskError("generate", "tb", ValueError("prompt too long")).as_instanceof_cause()
    assert not is_replica_failure(rejected)
    assert not is_replica_failure(RuntimeError("a bug"))


def test_the_deadline_bounds_the_wait_for_a_replica_to_take_a_request() -> None:
    now = [0.0]
    policy = FailoverPolicy(attempts=2, deadline_s=10, replica_timeout_s=4)
    retries = Retries(policy, lambda: now[0])
    assert retries.timeout_s() == 4 and retries.retry_id("r") == "r"
    retries.failed("decode", ActorDiedError())
    assert retries.retry_id("r") == "r-retry1"
    now[0] = 8.0
    assert retries.timeout_s() == 2  # what is left of the deadline
    retries.failed("decode", ActorDiedError())
    with pytest.raises(ServiceUnavailableError) as e:
        retries.failed("decode", ActorDiedError())
    assert e.value.status == 503 and "ActorDied" not in e.value.message
    late = Retries(FailoverPolicy(attempts=5, deadline_s=1), lambda: now[0])
    late.failed("prefill", ActorDiedError())
    now[0] = 9.5
    with pytest.raises(ServiceUnavailableError):
        late.failed("prefill", ActorDiedError())


def test_a_replica_that_took_the_request_is_bounded_by_silence_only() -> None:
    """Past the deadline a stream that resumed is never cut: each wait is replica_timeout_s."""
    now = [0.0]
    retries = Retries(FailoverPolicy(attempts=1, deadline_s=3, replica_timeout_s=4), lambda: now[0])
    retries.failed("decode", ActorDiedError())
    now[0] = 1.0
    retries.answered()  # a keepalive: the replica took it
    for now[0] in (2.0, 30.0, 1000.0):
        assert retries.timeout_s() == 4
    retries.progressed()
    # a later failure has a deadline and an attempt of its own, and a fresh request id
    retries.failed("decode", ActorDiedError())
    assert retries.retry_id("r") == "r-retry2" and retries.timeout_s() == 3
    now[0] = 1002.5
    assert retries.timeout_s() == 0.5


def test_attempts_count_failures_since_the_last_progress() -> None:
    """A request that kills each replica before a token ends; one that makes progress between
    failures may meet any number of them."""
    now = [0.0]
    retries = Retries(FailoverPolicy(attempts=2, deadline_s=100), lambda: now[0])
    for _ in range(10):
        retries.failed("decode", ActorDiedError())
        retries.answered()
        retries.progressed()
    retries.failed("decode", ActorDiedError())
    retries.answered()  # taken, but dies again before a token
    retries.failed("decode", ActorDiedError())
    with pytest.raises(ServiceUnavailableError):
        retries.failed("decode", ActorDiedError())


def test_a_pool_without_a_live_replica_costs_no_attempt_only_time() -> None:
    now = [0.0]
    retries = Retries(FailoverPolicy(attempts=0, deadline_s=5), lambda: now[0])
    for now[0] in (0.0, 1.0, 4.0):
        retries.failed("decode", failover.NoLiveReplicaError("decode"), counts=False)
    now[0] = 5.0
    with pytest.raises(ServiceUnavailableError):
        retries.failed("decode", failover.NoLiveReplicaError("decode"), counts=False)


def test_progress_resumes_from_what_was_sent() -> None:
    p = Progress("r")
    assert p.resume_point() is None
    p.add(RequestOutput(request_id="r", token_ids=[5], text="a", num_prompt_tokens=3), False)
    p.add(RequestOutput(request_id="r", token_ids=[6, 7], text="bc"))
    point = p.resume_point()
    assert point is not None and point.token_ids == [5, 6, 7] and point.text == "abc"
    assert point.kv is None and not point.finished and p.decoded


def test_undisturbed_stream() -> None:
    pools = Pools()
    check_whole(asyncio.run(collect(pools)))
    assert pools.released == []


def test_a_failed_prefill_is_retried_then_prefilled_by_decode() -> None:
    once = Pools(prefill_fails=[0])
    check_whole(asyncio.run(collect(once)))
    assert len(once.prefill.prefill.calls) == 2
    twice = Pools(prefill_fails=[0, 0])
    check_whole(asyncio.run(collect(twice)))
    [(req,)] = twice.decode.generate.calls  # no first chunk: decode prefilled it
    assert req.prompt_token_ids == PROMPT


def test_a_stalled_prefill_times_out_and_is_retried() -> None:
    pools = Pools(prefill_fails=[-1])
    check_whole(asyncio.run(asyncio.wait_for(collect(pools), 5)))


def test_decode_death_mid_stream_resumes_without_repeating_a_token() -> None:
    pools = Pools(decode_fails=[3, 2])
    check_whole(asyncio.run(collect(pools)))
    calls = pools.decode.generate.calls
    assert len(calls) == 3
    resumed_req, resumed = calls[1]
    assert resumed.kv is None and resumed.token_ids == [token(i) for i in range(4)]
    assert resumed_req.request_id == "r-retry1"
    assert pools.released == []  # the first decode replica had read the pages


def test_a_decode_death_after_the_last_chunk_sends_nothing_more() -> None:
    """The replica dies between its last chunk and its stream's end: the request is whole. A
    re-send would resume from every token and stream one past max_tokens after the last chunk."""
    pools = Pools(decode_fails=[MAX_TOKENS - 1])
    check_whole(asyncio.run(collect(pools)))
    assert len(pools.decode.generate.calls) == 1


def test_decode_death_before_its_first_chunk_hands_the_same_kv_to_another() -> None:
    pools = Pools(decode_fails=[0])
    check_whole(asyncio.run(collect(pools)))
    (_, first), (_, again) = pools.decode.generate.calls
    assert again.kv == first.kv == handle_kv()


def test_colocated_stream_resumes_too() -> None:
    pools = Pools(decode_fails=[0, 5])
    check_whole(asyncio.run(collect(pools, threshold=100)))
    assert pools.prefill.prefill.calls == []
    assert len(pools.decode.generate.calls[1]) == 1  # nothing sent yet: start over
    assert pools.decode.generate.calls[2][1].token_ids == [token(i) for i in range(5)]


def test_no_replica_in_time_is_a_503_and_the_lease_is_released() -> None:
    pools = Pools(decode_fails=[-1] * 10)
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(asyncio.wait_for(collect(pools), 5))
    assert pools.released == ["lease"]
    assert len(pools.decode.generate.calls) == FAST.attempts + 1


def test_a_rejected_request_is_not_retried() -> None:
    pools = Pools()

    async def reject(req: GenerateRequest) -> RequestOutput:
        raise ValueError("prompt too long")

    pools.prefill.prefill = Method(reject)
    with pytest.raises(ValueError, match="too long"):
        asyncio.run(collect(pools))
    assert len(pools.prefill.prefill.calls) == 1


def test_a_resumed_stream_runs_long_past_the_deadline() -> None:
    """The decode replica dies after 2 tokens; the next one streams slower than the deadline
    allows in total (8 x 0.1 s against 0.3 s): no wait for a replica is past it, so it ends."""
    pools = Pools(decode_fails=[2], pause_s=0.1)
    policy = FailoverPolicy(attempts=1, deadline_s=0.3, replica_timeout_s=0.5)
    check_whole(asyncio.run(asyncio.wait_for(collect(pools, policy=policy), 10)))
    assert len(pools.decode.generate.calls) == 2


def test_a_busy_replica_sending_keepalives_is_not_dead() -> None:
    """1.2 s before each token, a keepalive every 0.1 s: never 0.5 s silent, so never failed."""
    pools = Pools(pause_s=1.2, keepalive_s=0.1)
    policy = FailoverPolicy(attempts=0, deadline_s=0.3, replica_timeout_s=0.5)
    chunks = asyncio.run(asyncio.wait_for(collect(pools, policy=policy), 30))
    check_whole(chunks)  # no keepalive reaches the client
    assert len(pools.decode.generate.calls) == 1


def test_a_silent_replica_times_out() -> None:
    pools = Pools(decode_fails=[None], pause_s=1.0)  # no keepalives: silent past 0.5 s
    policy = FailoverPolicy(attempts=1, deadline_s=5, replica_timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(asyncio.wait_for(collect(pools, policy=policy), 10))


def test_without_a_live_decode_replica_the_prefill_replica_runs_the_request() -> None:
    pools = Pools()
    board = Board("decode")
    check_whole(asyncio.run(collect(pools, board=board)))
    assert pools.prefill.prefill.calls == [] and pools.decode.generate.calls == []
    [(req,)] = pools.prefill.generate.calls  # whole, from the start
    assert req.prompt_token_ids == PROMPT


async def collect_then_down(pools: Pools, pool: str, after: int) -> list[RequestOutput]:
    """The request's chunks; once `after` have come, the board shows `pool` without a live
    replica."""
    board = Board()
    backend = DisaggregatedBackend(pools.prefill, pools.decode, None, 0, FAST)
    backend.live = board  # type: ignore[assignment]  # a fake PoolLiveness
    out = []
    async for chunk in backend.generate(request()):
        out.append(chunk)
        if len(out) == after:
            board.down_pools.add(pool)
    return out


def test_a_stream_resumes_on_the_prefill_replica_when_the_decode_pool_is_gone() -> None:
    """The one decode replica dies mid-stream and the board shows none live: the prefill replica
    resumes from every token sent, neither repeating nor skipping one."""
    pools = Pools(decode_fails=[3])
    check_whole(asyncio.run(collect_then_down(pools, "decode", after=4)))  # dies after it
    [(_, resumed)] = pools.prefill.generate.calls
    assert resumed.kv is None and resumed.token_ids == [token(i) for i in range(4)]
    assert pools.released == []  # the decode replica had read the pages


def test_a_prompt_whose_decode_pool_dies_before_reading_is_run_by_the_prefill_replica() -> None:
    """The decode pool goes after the first token: no decode replica takes the prefilled pages;
    they are released, and the prefill replica decodes from the first token (its prefix cache
    holds the prompt)."""
    pools = Pools()
    check_whole(asyncio.run(collect_then_down(pools, "decode", after=1)))
    [(_, resumed)] = pools.prefill.generate.calls
    assert resumed.kv is None and resumed.token_ids == [token(0)]
    assert pools.released == ["lease"]


def test_without_a_live_prefill_replica_decode_prefills_at_once() -> None:
    pools = Pools(prefill_fails=[-1])  # it would hang: never asked
    check_whole(asyncio.run(asyncio.wait_for(collect(pools, board=Board("prefill")), 5)))
    assert pools.prefill.prefill.calls == []
    [(req,)] = pools.decode.generate.calls
    assert req.prompt_token_ids == PROMPT


def test_a_prefill_waiting_on_a_pool_that_dies_goes_to_decode_within_a_poll() -> None:
    """The prefill replica hangs and then the board shows the pool dead: the request leaves it
    at the next liveness poll, long before replica_timeout_s."""
    pools = Pools(prefill_fails=[-1])
    board = Board()
    policy = FailoverPolicy(attempts=3, deadline_s=60, replica_timeout_s=60)

    async def run() -> list[RequestOutput]:
        asyncio.get_running_loop().call_later(0.2, board.down_pools.add, "prefill")
        return await collect(pools, policy=policy, board=board)

    check_whole(asyncio.run(asyncio.wait_for(run(), 5)))
    assert len(pools.prefill.prefill.calls) == 1 and len(pools.decode.generate.calls) == 1
