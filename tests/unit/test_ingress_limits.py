"""The ingress's limits on a backend that answers when told to: 413 for a large body before it is
parsed, 429 beyond the queue bound or a pool's, /health from the pool watch, tokenization
off the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from ray.serve.exceptions import BackPressureError

from router.admission import IngressLimits
from router.backend import RoleStats
from router.health import PoolWatch
from router.openai_api import build_openai_app
from workers.api import GenerateRequest, RequestOutput
from workers.model.files import load_tokenizer

pytestmark = pytest.mark.asyncio

MODEL = "smollm2-135m-instruct"
LIMITS = IngressLimits(max_request_bytes=64 << 10, max_queued_requests=3, retry_after_s=2)


class GatedBackend:
    """Answers every request with one token once `gate` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.started += 1
        await self.gate.wait()
        yield RequestOutput(request_id=req.request_id, token_ids=[42], text="x",
                            finish_reason="length")

    async def stats(self) -> list[RoleStats]:
        return []


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Any:
    return load_tokenizer(smollm2_dir)


def app_with(backend: Any, tokenizer: Any, **kw: Any) -> Any:
    return build_openai_app(backend, tokenizer, MODEL, 2048, limits=LIMITS, **kw)


def http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test",
                             timeout=30)


async def test_a_large_body_is_413_with_an_openai_error_declared_or_streamed(tokenizer) -> None:
    app = app_with(GatedBackend(), tokenizer)
    big = b'{"prompt": "' + b"a" * (LIMITS.max_request_bytes + 1) + b'"}'

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    async with http(app) as c:
        for content in (big, chunks()):
            r = await c.post("/v1/completions", content=content,
                             headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == 413 and err["type"] == "RequestTooLargeError"
            assert str(LIMITS.max_request_bytes) in err["message"]
        # Under the limit, the body reaches the app whole.
        r = await c.post("/v1/completions", json={"model": "other", "prompt": "a" * 1000})
        assert r.status_code == 404


async def test_beyond_the_queue_bound_is_429_with_retry_after_and_counted(tokenizer) -> None:
    backend = GatedBackend()
    app = app_with(backend, tokenizer)
    body = {"prompt": "Once upon a time", "max_tokens": 1}
    async with http(app) as c:
        n = 10 * LIMITS.max_queued_requests
        tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(n)]
        while backend.started < LIMITS.max_queued_requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the others have been answered
        backend.gate.set()
        replies = await asyncio.gather(*tasks)
        metrics = (await c.get("/metrics")).text
        # The first token frees the place: the queue takes new requests again.
        after = await c.post("/v1/completions", json=body)
    codes = sorted(r.status_code for r in replies)
    assert codes == [200] * LIMITS.max_queued_requests + [429] * (n - LIMITS.max_queued_requests)
    busy = next(r for r in replies if r.status_code == 429)
    assert busy.headers["retry-after"] == "2"
    assert busy.json()["error"]["type"] == "RateLimitError"
    rejected = f'pdserve:request_rejected_total{{model_name="{MODEL}",reason="queue_full"}}'
    assert f"{rejected} {float(n - LIMITS.max_queued_requests)}" in metrics
    assert after.status_code == 200


class FullPoolBackend:
    """A worker pool at its bound of queued calls while `full`: its handle raises at once."""

    def __init__(self) -> None:
        self.full = True

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.full:
            raise BackPressureError(num_queued_requests=4, max_queued_requests=4)
        yield RequestOutput(request_id=req.request_id, token_ids=[42], text="x",
                            finish_reason="length")

    async def stats(self) -> list[RoleStats]:
        return []


async def test_a_full_pool_is_429_with_retry_after_streamed_or_not_and_counted(tokenizer) -> None:
    backend = FullPoolBackend()
    app = app_with(backend, tokenizer)
    body = {"prompt": "Once upon a time", "max_tokens": 1}
    async with http(app) as c:
        n = 2 * LIMITS.max_queued_requests  # more than the router's queue: no place is kept
        replies = [await c.post("/v1/completions", json={**body, "stream": i % 2 == 0})
                   for i in range(n)]
        metrics = (await c.get("/metrics")).text
        backend.full = False
        after = await c.post("/v1/completions", json=body)
    for r in replies:
        assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
        err = r.json()["error"]
        assert err["type"] == "RateLimitError" and "queued" in err["message"]
        assert "BackPressure" not in err["message"]
    rejected = 'pdserve:request_rejected_total{model_name="%s",reason="%s"}'
    assert f"{rejected % (MODEL, 'pool_full')} {float(n)}" in metrics
    assert f"{rejected % (MODEL, 'queue_full')} 0.0" in metrics
    assert after.status_code == 200


def status(replicas: dict[str, int]) -> SimpleNamespace:
    """What `serve.status()` says of app "pd": each deployment's RUNNING replicas."""
    deployments = {
        name: SimpleNamespace(replica_states={"RUNNING": n} if n else {"STARTING": 1})
        for name, n in replicas.items()
    }
    return SimpleNamespace(applications={"pd": SimpleNamespace(deployments=deployments)})


async def test_health_is_503_while_a_pool_has_no_live_replica(tokenizer) -> None:
    replicas = {"prefill": 1, "decode": 1}
    watch = PoolWatch("pd", ["prefill", "decode"], status=lambda: status(replicas))
    app = app_with(GatedBackend(), tokenizer, health=watch)
    async with http(app) as c:
        r = await c.get("/health")  # before the first check nothing is known to be up
        assert r.status_code == 503 and "not been read yet" in r.json()["error"]["message"]
        watch.check()
        assert (await c.get("/health")).status_code == 200
        replicas["prefill"] = 0
        watch.check()
        r = await c.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == (
            "no live replica in the prefill pool (prefill: {'STARTING': 1})"
        )
        replicas["prefill"] = 2
        watch.check()
        assert (await c.get("/health")).status_code == 200


async def test_health_answers_while_a_huge_prompt_is_tokenized(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat template and the tokenizer run off the event loop: `/health` answers while
    they are held (on an event, so the test does not depend on how fast they are)."""
    entered, release = threading.Event(), threading.Event()
    template = tokenizer.apply_chat_template

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30), "never released: /health did not answer"
        return template(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", held)
    limits = IngressLimits(max_request_bytes=8 << 20, max_queued_requests=8, retry_after_s=1)
    app = build_openai_app(GatedBackend(), tokenizer, MODEL, 2048, limits=limits)
    huge = {"messages": [{"role": "user", "content": "hello world. " * 60_000}]}
    async with http(app) as c:
        chat = asyncio.create_task(c.post("/v1/chat/completions", json=huge))
        assert await asyncio.to_thread(entered.wait, 30)  # parsed; in the chat template now
        t0 = time.monotonic()
        health = await c.get("/health")
        waited = time.monotonic() - t0
        assert not chat.done()
        release.set()
        reply = await chat
    assert health.status_code == 200 and waited < 0.5
    assert reply.status_code == 400 and "maximum context length" in reply.text
