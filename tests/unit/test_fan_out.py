"""`merge_streams` with leaders: a prompt's other choices start at its first choice's first chunk
(in real Serve: tests/e2e/test_serve_reliability.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.errors import APIError
from router.generation import merge_streams
from workers.api import RequestOutput

pytestmark = pytest.mark.asyncio


class Choice:
    """A stream of `n` chunks that logs when it starts and ends; fails first if `fail`."""

    def __init__(self, name: str, log: list[str], n: int = 2, fail: bool = False) -> None:
        self.name, self.log, self.n, self.fail = name, log, n, fail
        self.closed = False

    async def run(self) -> AsyncIterator[RequestOutput]:
        self.log.append(f"{self.name} starts")
        try:
            if self.fail:
                raise ConnectionError(f"{self.name} lost")
            for k in range(self.n):
                await asyncio.sleep(0.01)
                self.log.append(f"{self.name} {k}")
                yield RequestOutput(request_id=self.name, token_ids=[k])
        finally:
            self.closed = True


async def test_followers_start_at_their_leaders_first_chunk() -> None:
    log: list[str] = []
    choices = [Choice(name, log) for name in ("p0c0", "p0c1", "p0c2", "p1c0", "p1c1")]
    merged = merge_streams([c.run() for c in choices], leaders=[0, 0, 0, 3, 3])
    got = [(i, out.token_ids[0]) async for i, out in merged]
    assert sorted(got) == [(i, k) for i in range(5) for k in range(2)]
    assert log[:2] == ["p0c0 starts", "p1c0 starts"]  # the leaders, together
    for leader, follower in (("p0c0", "p0c1"), ("p0c0", "p0c2"), ("p1c0", "p1c1")):
        assert log.index(f"{leader} 0") < log.index(f"{follower} starts")


async def test_a_failing_leader_fails_the_request_and_closes_every_stream() -> None:
    log: list[str] = []
    choices = [Choice("c0", log, fail=True), Choice("c1", log, n=50)]
    streams = [c.run() for c in choices]
    with pytest.raises(APIError, match="c0 lost"):
        async for _ in merge_streams(streams, leaders=[0, 0]):
            pass
    assert "c1 49" not in log and all(c.closed or "c1 starts" not in log for c in choices)


async def test_leaving_before_the_leaders_first_chunk_closes_followers_unstarted() -> None:
    log: list[str] = []
    leader = Choice("c0", log)
    streams = [leader.run(), Choice("c1", log).run()]
    merged = merge_streams(streams, leaders=[0, 0])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(anext(merged), 0.001)  # the client went away
    assert leader.closed and log == ["c0 starts"]
    with pytest.raises(StopAsyncIteration):
        await anext(streams[1])  # closed before it ran
