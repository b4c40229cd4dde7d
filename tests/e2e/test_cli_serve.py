"""`pdserve serve CONFIG --port P --set ...` for real: the overrides reach the running app (its
context length, and a pool bound whose burst is refused with 429s), and Ctrl-C takes it down.

The overrides make it the reliability issue's "tight" application: colocated, one decode replica
that takes 1 call and queues 1 more (`decode.max_ongoing_requests`, `decode.max_queued_requests`),
the router's own bound far: a burst beyond the pool's bound is refused by the pool, cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.app_process import REPO, app_process
from workers.parallel.rendezvous import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.own_ray]

MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 60
OVERRIDES = ["mode=colocated", "engine.max_model_len=384", "decode.num_cpus_per_rank=0.5",
             "engine.kv_cache_memory_gb=0.25", "decode.max_ongoing_requests=1",
             "decode.max_queued_requests=1", "router.max_queued_requests=64"]  # fmt: skip


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """The base URL and the process of `pdserve serve configs/local.yaml` with OVERRIDES."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "cluster.cli", "serve", str(REPO / "configs" / "local.yaml"),
               "--port", str(port)] + [a for o in OVERRIDES for a in ("--set", o)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("cli") / "pdserve.log"
    with app_process(command, log.parent, log, base) as proc:
        yield base, proc


def test_pdserve_serve_runs_a_config_with_overrides(app: tuple[str, subprocess.Popen]) -> None:
    base, _ = app
    [model] = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    assert model["id"] == MODEL and model["max_model_len"] == 384
    body = {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 4}
    body["ignore_eos"] = True  # exactly 4 tokens, whatever the sampling defaults
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_full_pool_is_429_with_retry_after_and_counted(app: tuple[str, subprocess.Popen]) -> None:
    """A burst beyond the pool's bound is refused by the pool, cleanly."""
    base, _ = app
    body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 16, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as c:
            return await asyncio.gather(
                *(c.post(f"{base}/v1/completions", json=body) for _ in range(8))
            )

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    for r in replies:
        if r.status_code == 429:
            error = r.json()["error"]
            assert r.headers["retry-after"] == "1" and error["type"] == "RateLimitError"
            assert "queued" in error["message"] and "BackPressure" not in error["message"]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text
    rejected = 'pdserve:request_rejected_total{model_name="%s",reason="%s"}'
    assert f"{rejected % (MODEL, 'pool_full')} {float(codes.count(429))}" in metrics
    assert f"{rejected % (MODEL, 'queue_full')} 0.0" in metrics
    # The refused calls left nothing behind: the pool serves again.
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT_S).is_success


def test_ctrl_c_takes_it_down(app: tuple[str, subprocess.Popen]) -> None:
    _, proc = app
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 0
