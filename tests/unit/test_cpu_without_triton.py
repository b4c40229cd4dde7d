"""The CPU path imports no Triton: torch's CPU build lacks it and only the test extras install
it, so a module that imports a Triton kernel at its top would break `pip install` + `serve run`
on a CPU machine. Kernel modules are imported on first CUDA use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
BLOCK = "import sys; sys.modules['triton'] = None  # any import of triton raises ImportError\n"
MODULES = ["workers.llm", "workers.engine.engine", "workers.model.moe", "workers.lora.manager",
           "workers.serve.decode", "workers.serve.prefill"]  # fmt: skip


def test_the_engine_and_models_import_without_triton() -> None:
    code = BLOCK + "".join(f"import {m}\n" for m in MODULES)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
