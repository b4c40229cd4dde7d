"""Every admitted request that ends in an error is counted once by kind in
`request_errors_total`, and its choices as "error" in `request_success_total` (a backend
scripted to fail; SmolLM2's tokenizer only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.backend import RoleStats
from router.errors import APIError
from router.openai_api import build_openai_app
from workers.api import GenerateRequest, RequestOutput
from workers.model.files import load_tokenizer

pytestmark = pytest.mark.asyncio

MODEL = "m"


class FailingBackend:
    """Fails each request: before its first chunk by raising `exc` when set, else with an
    engine error chunk after one token."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.exc is not None:
            raise self.exc
        yield RequestOutput(request_id=req.request_id, token_ids=[42], text="x")
        yield RequestOutput(request_id=req.request_id, token_ids=[], finish_reason="error",
                            error="step failed")

    async def stats(self) -> list[RoleStats]:
        return []


def counts(text: str) -> dict[str, float]:
    """kind -> errors, and "success:<reason>" -> choices."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name == "pdserve:request_errors":
                out[s.labels["kind"]] = s.value
            elif family.name == "pdserve:request_success":
                out[f"success:{s.labels['finished_reason']}"] = s.value
    return out


async def test_errors_are_counted_once_by_kind(smollm2_dir: Any) -> None:
    backend = FailingBackend()
    app = build_openai_app(backend, load_tokenizer(smollm2_dir), MODEL, 64)
    body = {"prompt": "Hi", "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:

        async def after(status: int, **extra: Any) -> dict[str, float]:
            r = await c.post("/v1/completions", json={**body, **extra})
            assert r.status_code == status, r.text
            return counts((await c.get("/metrics")).text)

        got = await after(500)  # an engine error chunk
        assert got["internal"] == 1 and got["success:error"] == 1
        got = await after(200, stream=True)  # the same streamed: an error event after the 200
        assert got["internal"] == 2 and got["success:error"] == 2
        backend.exc = ConnectionError("replica lost")
        got = await after(500, n=2)  # one HTTP error, two failed choices
        assert got["internal"] == 3 and got["success:error"] == 4
        got = await after(500, stream=True)  # before the first chunk: a 500, not a stream
        assert got["internal"] == 4 and got["success:error"] == 5
        backend.exc = APIError("no decode replica could serve the request in time", status=503)
        got = await after(503)
        assert got["unavailable"] == 1 and got["success:error"] == 6
        backend.exc = ValueError("token id out of range")
        got = await after(400)
        assert got["invalid"] == 1 and got["success:error"] == 7
        got = await after(400, prompt="many words " * 100)  # too long: no engine request made
        assert got["invalid"] == 2 and got["success:error"] == 7
        got = await after(404, model="other")  # turned away before admission: not counted
        assert got["invalid"] == 2 and got["abort"] == 0 and got["internal"] == 4
