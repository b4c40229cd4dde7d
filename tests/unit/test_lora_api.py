"""LoRA adapters through the OpenAI app on the real colocated engine (SmolLM2, CPU): a request's
`model` picks the adapter (tokens as HF PEFT's), /v1/models lists adapters with their parent,
runtime load/unload with vLLM's status codes, and unknown names are 404."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from router.lora_registry import LoRARegistry, lora_int_id
from router.metric_names import Naming
from router.metrics import Metrics
from router.openai_api import LocalBackend, RoleStats, build_openai_app
from tests.conftest import hf_greedy
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model
from tests.unit.conftest import MODEL, http
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The capital of France is"
TOKENS = 6


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[Path]:
    tmp = tmp_path_factory.mktemp("api-loras")
    return [
        make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1),
        make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, ["q_proj", "v_proj"], seed=2),
    ]


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[AsyncEngine]:
    cfg = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    eng = AsyncEngine(Engine(cfg))
    yield eng
    eng.shutdown()


def _app(engine: AsyncEngine, adapter_dirs: list[Path], runtime: bool) -> FastAPI:
    registry = LoRARegistry(MODEL, {"lora-a": str(adapter_dirs[0])}, max_lora_rank=8)
    return build_openai_app(LocalBackend(engine), engine.engine.tokenizer, MODEL,
                            engine.engine.max_model_len, loras=registry,
                            allow_runtime_lora_updating=runtime)  # fmt: skip


@pytest.fixture(scope="module")
def app(lora_engine: AsyncEngine, adapter_dirs: list[Path]) -> FastAPI:
    return _app(lora_engine, adapter_dirs, runtime=True)


async def _complete(app: Any, model: str) -> Any:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    async with http(app) as c:
        return await c.post("/v1/completions", json=body)


async def test_model_name_picks_the_adapter(app, adapter_dirs, smollm2_dir, hf_smollm2) -> None:
    base, adapted = await asyncio.gather(_complete(app, MODEL), _complete(app, "lora-a"))
    assert base.status_code == adapted.status_code == 200, adapted.text
    assert adapted.json()["model"] == "lora-a"
    tok = app.state.backend.engine.engine.tokenizer
    prompt = tok.encode(PROMPT)
    expected = tok.decode(hf_greedy(peft_model(smollm2_dir, adapter_dirs[0]), prompt, TOKENS))
    assert adapted.json()["choices"][0]["text"] == expected
    assert base.json()["choices"][0]["text"] == tok.decode(hf_greedy(hf_smollm2, prompt, TOKENS))
    assert expected != base.json()["choices"][0]["text"]


async def test_models_list_adapters_with_parent(app, adapter_dirs) -> None:
    async with http(app) as c:
        cards = (await c.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"]) for m in cards] == [(MODEL, None), ("lora-a", MODEL)]
    assert cards[1]["root"] == str(adapter_dirs[0])


async def test_unknown_model_is_404(app) -> None:
    r = await _complete(app, "no-such-adapter")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `no-such-adapter` does not exist."


async def test_runtime_load_then_unload(app, adapter_dirs, tmp_path: Path) -> None:
    b = str(adapter_dirs[1])
    async with http(app) as c:
        load = lambda body: c.post("/v1/load_lora_adapter", json=body)  # noqa: E731
        unload = lambda body: c.post("/v1/unload_lora_adapter", json=body)  # noqa: E731
        r = await load({"lora_name": "lora-b"})
        assert r.status_code == 400 and "Both 'lora_name' and 'lora_path'" in r.text
        r = await load({"lora_name": "lora-b", "lora_path": str(tmp_path)})
        assert r.status_code == 404 and "No adapter found" in r.json()["error"]["message"]
        r = await load({"lora_name": "lora-b", "lora_path": b})
        assert (
            r.status_code == 200 and r.text == "Success: LoRA adapter 'lora-b' added successfully."
        )
        r = await load({"lora_name": "lora-b", "lora_path": b})
        assert r.status_code == 400 and "already been loaded" in r.text
        ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        assert ids == [MODEL, "lora-a", "lora-b"]
        assert (await _complete(app, "lora-b")).status_code == 200
        r = await unload({"lora_name": "lora-b"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert (await _complete(app, "lora-b")).status_code == 404
        r = await unload({"lora_name": "lora-b"})
        assert r.status_code == 404 and "cannot be found" in r.text
        r = await unload({})
        assert r.status_code == 400


async def test_runtime_updates_need_the_switch(lora_engine, adapter_dirs) -> None:
    closed = _app(lora_engine, adapter_dirs, runtime=False)
    async with http(closed) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert r.status_code == 404


async def test_adapter_ids_are_stable_and_distinct() -> None:
    assert lora_int_id("a", "/p") == lora_int_id("a", "/p") > 0
    assert lora_int_id("a", "/p") != lora_int_id("a", "/q")


async def test_lora_requests_info_in_both_namings(lora_engine) -> None:
    """vLLM's info gauge: the adapters of the live replicas' running and waiting requests."""
    stats = lora_engine.engine.stats()
    assert stats.max_loras == 2
    busy = stats.model_copy(update={"lora_running": ["lora-a"], "lora_waiting": ["lora-b"]})
    other = stats.model_copy(update={"lora_running": ["lora-c"]})
    dead = stats.model_copy(update={"lora_running": ["gone"]})
    snapshot = [RoleStats("colocated", busy), RoleStats("colocated", other),
                RoleStats("colocated", dead, live=False)]  # fmt: skip
    ours = Metrics(MODEL).render(snapshot).decode()
    theirs = Metrics(MODEL, naming=Naming("vllm")).render(snapshot).decode()
    adapters = 'running_lora_adapters="lora-a,lora-c",waiting_lora_adapters="lora-b"'
    assert f'pdserve:lora_requests_info{{max_lora="2",role="colocated",{adapters}}}' in ours
    assert f'vllm:lora_requests_info{{engine="colocated",max_lora="2",{adapters}}}' in theirs
