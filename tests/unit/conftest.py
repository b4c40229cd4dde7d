"""The OpenAI app on the real colocated engine (SmolLM2, CPU), shared by the API's test modules:
one engine per module, driven in-process through httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from router.openai_api import LocalBackend, build_openai_app
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(Engine(EngineConfig(stream_interval_ms=0)))  # a chunk per token
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> FastAPI:
    return build_openai_app(LocalBackend(engine), engine.engine.tokenizer, MODEL,
                            engine.engine.max_model_len)


def http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
