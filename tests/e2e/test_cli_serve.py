"""`pdserve serve CONFIG --port P --set ...` for real: the overrides reach the running app, and
Ctrl-C takes it down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from workers.tp import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_pdserve_serve_runs_a_config_with_overrides(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    overrides = ["engine.max_model_len=384", "prefill.num_cpus_per_rank=0.5",
                 "decode.num_cpus_per_rank=0.5"]  # fmt: skip
    command = [sys.executable, "-m", "cluster.cli", "serve", str(REPO / "configs" / "local.yaml"),
               "--port", str(port)] + [a for o in overrides for a in ("--set", o)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path / "pdserve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, f"pdserve serve exited: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 240, "the application did not come up"
            time.sleep(1)
        [model] = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert model["id"] == "smollm2-135m-instruct" and model["max_model_len"] == 384
        body = {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 4}
        body["ignore_eos"] = True  # exactly 4 tokens, whatever the sampling defaults
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60)
