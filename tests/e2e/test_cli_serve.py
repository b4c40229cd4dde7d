"""`pdserve serve CONFIG --port P --set ...` for real: the overrides reach the running app, and
Ctrl-C takes it down."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.app_process import REPO, app_process
from workers.parallel.rendezvous import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.own_ray]


def test_pdserve_serve_runs_a_config_with_overrides(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    # colocated: one replica fewer to start (test_serve_app.py runs the config as it is)
    overrides = ["mode=colocated", "engine.max_model_len=384", "decode.num_cpus_per_rank=0.5"]
    command = [sys.executable, "-m", "cluster.cli", "serve", str(REPO / "configs" / "local.yaml"),
               "--port", str(port)] + [a for o in overrides for a in ("--set", o)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with app_process(command, tmp_path, tmp_path / "pdserve.log", base) as proc:
        [model] = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert model["id"] == "smollm2-135m-instruct" and model["max_model_len"] == 384
        body = {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 4}
        body["ignore_eos"] = True  # exactly 4 tokens, whatever the sampling defaults
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
