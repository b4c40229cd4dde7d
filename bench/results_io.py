"""Benchmark result files: one JSON per run, the format `python -m bench.report` renders.

A result file holds what a reader needs to trust and repeat a figure: the command, the
hardware, the package versions, the date, the model or shapes, and the rows. Row keys carry
their unit as a suffix (`_ms`, `_us`, `_gbps`, `_tflops`, `_per_s`, ...); a row that is measured
against a reference holds the reference and the ratio too (`floor_ms` and `x_floor`). A value
may be a number, a string, null (not measured) or `[low, high]` (the range over several runs).

    from bench.results_io import add_out_argument, write_result
    write_result(args.out, "decode", rows, model="Llama-3-8B shapes, random bf16 weights")
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

# Package -> the distribution names it ships under (the first installed one is reported).
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "transformers": ("transformers",),
    "ray": ("ray",),
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),
}


def add_out_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, help="write a result file (bench/results format) here")


def command_line() -> str:
    """How this process was started, as a reader would type it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(sys.argv[0])
        with contextlib.suppress(ValueError):  # a script outside the working directory
            script = script.resolve().relative_to(Path.cwd())
        head = ["python", str(script)]
    return shlex.join(head + [_public(arg) for arg in sys.argv[1:]])


def _public(arg: str) -> str:
    """`arg` as a result file shows it: a folder as DIR and a file by its name, since where
    they lay on the machine that ran the command means nothing to a reader."""
    path = Path(arg)
    if not arg.startswith("-") and path.is_dir():
        return "DIR"
    if not arg.startswith("-") and path.is_file():
        return path.name
    return arg


def hardware() -> str:
    """`2x NVIDIA H200`, or the CPU's model and core count when no GPU is visible."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores"


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def software() -> dict[str, str]:
    """Installed versions of the packages a figure depends on (absent ones left out)."""
    versions = {"python": platform.python_version()}
    for package, dists in PACKAGES.items():
        for dist in dists:
            try:
                versions[package] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def result_slug(hw: str) -> str:
    """File-name part for the hardware: `h200`, `h100x2`, `cpu`: the GPU's model, the first
    word of its name that is letters then digits ("NVIDIA H100 80GB HBM3": h100)."""
    if hw.startswith("CPU"):
        return "cpu"
    count, _, name = hw.partition("x ")
    words = [w for w in name.split() if re.fullmatch(r"[A-Za-z]+\d+", w)]
    model = words[0].lower() if words else "gpu"
    return model if count == "1" else f"{model}x{count}"


def write_result(
    out: Path | None,
    name: str,
    rows: list[dict[str, Any]],
    *,
    model: str,
    title: str | None = None,
    measured: dict[str, Any] | None = None,
    notes: str | None = None,
    requests: dict[str, list[dict[str, Any]]] | None = None,
) -> Path | None:
    """Write `rows` as `out/{name}_{hardware}_{date}.json`; nothing when `out` is None.
    `measured`: the run's own ceilings (copy bandwidth, GEMM peak) its references come from;
    `requests`: per-request figures by series (TTFT/TPOT distributions)."""
    if out is None:
        return None
    hw = hardware()
    date = datetime.date.today().isoformat()
    result: dict[str, Any] = {
        "benchmark": name,
        "title": title or name,
        "command": command_line(),
        "hardware": hw,
        "software": software(),
        "date": date,
        "model": model,
        "rows": rows,
    }
    if measured:
        result["measured"] = measured
    if notes:
        result["notes"] = notes
    if requests:
        result["requests"] = requests
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{result_slug(hw)}_{date}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"result file: {path}", flush=True)
    return path
