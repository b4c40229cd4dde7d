"""The disaggregated backend's failover against fake pools: which failures are retried, that a
resumed stream neither repeats nor skips a token, that every wait is bounded, and that a request
no replica could serve ends with a 503 and leaves no lease pinned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

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
    (-1: hang)."""

    def __init__(self, prefill_fails: list[int | None] = (), decode_fails: list[int | None] = ()):
        self.prefill_fails, self.decode_fails = list(prefill_fails), list(decode_fails)
        self.released: list[str] = []
        self.prefill = Handle(prefill=Method(self._prefill), release=Method(self._release))
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


async def collect(pools: Pools, threshold: int = 0) -> list[RequestOutput]:
    backend = DisaggregatedBackend(pools.prefill, pools.decode, None, threshold, FAST)
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


def test_retries_are_bounded_by_attempts_and_deadline() -> None:
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
