"""Decode step with an FP8 KV cache against bf16 KV, each against its own floor.

Random Llama-3-8B weights in bf16 on one GPU; the KV pool in bf16 (`kv_cache_dtype=auto`) and
then in FP8 (`fp8_e4m3`), each engine in a process of its own (one H200 holds either pool at its
largest case, not both). Per case (batch x context) and KV dtype: the overlapped step
(`bench_decode.overlapped_ms`, the engine's pipelining without its scheduler) and the CUDA graph
replay, against the floor: the weights once plus the sequences' KV bytes (half with FP8) at the
copy rate measured in the same process. `fp8_vs_bf16` is the FP8 step over the bf16 step of
the same case, measured in the same run. 256 x 4096 runs in FP8 only: its bf16 KV (128 GiB)
and the weights exceed one H200, its FP8 KV (64 GiB) does not. Goal: FP8 at 64 x 4096 within
1.15x its floor.

    python -m bench.bench_fp8_decode --tokenizer-dir DIR [--out DIR] [--cases 1x4096,64x4096]
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --device cpu   # smoke test: tiny shape
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch

from bench.bench_decode import decode_step, overlapped_ms
from bench.gpu_common import (
    bench_parser,
    copy_bandwidth_gbps,
    cuda_ms,
    decode_config,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result
from workers.engine.model_runner import ModelRunner

CASES = [(1, 4096), (16, 4096), (64, 4096), (256, 2048), (256, 4096)]
FP8_ONLY = {(256, 4096)}
CPU_CASES = [(1, 64), (4, 128)]  # --device cpu: the tiny shape, a smoke test of the mechanics
KV_DTYPES = ("auto", "fp8_e4m3")
ROW = "FP8ROW "  # a worker's result line


def fill_random(runner: ModelRunner, pages_at_once: int = 1024) -> None:
    """Random KV (attention over zeros would be no test), a slice of pages at a time: FP8 has
    no `normal_`, and one bf16 copy of a 64 GiB pool would not fit beside it."""
    pages = runner.pool.pages
    for start in range(0, pages.shape[0], pages_at_once):
        part = pages[start : start + pages_at_once]
        part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=part.device))


def cpu_copy_gbps(mib: int = 256) -> float:
    src = torch.empty(mib * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * mib * 2**20 / wall_ms(lambda: dst.copy_(src), warmup=1, iters=5) / 1e6


def worker(args: argparse.Namespace, kv_cache_dtype: str, cases: list[tuple[int, int]]) -> None:
    """Measure `cases` with one KV dtype; print one ROW line per case."""
    from workers.engine.engine import Engine

    cpu = args.device == "cpu"
    fields: dict[str, Any] = dict(kv_cache_dtype=kv_cache_dtype)
    if cpu:
        fields.update(device="cpu", attention_backend="torch", enforce_eager=True)
    runner = Engine(decode_config(args, cases, **fields)).runner
    fill_random(runner)
    bandwidth = cpu_copy_gbps() if cpu else copy_bandwidth_gbps()
    kv_per_token = runner.kv_layout.page_bytes // runner.cfg.page_size
    for batch, context in cases:
        step = decode_step(runner, batch, context)
        step_ms = overlapped_ms(runner, step, iters=5 if cpu else 30)
        replay = None
        if runner.graphs is not None:
            replay = cuda_ms(runner.graphs.graphs[batch].replay)
        nbytes = weight_bytes_read(runner, batch) + batch * context * kv_per_token
        floor_ms = nbytes / bandwidth / 1e6
        row = dict(
            kv_cache_dtype=kv_cache_dtype, batch=batch, context=context,
            kv_gib=round(batch * context * kv_per_token / 2**30, 2),
            overlap_ms=round(step_ms, 3),
            graph_replay_ms=None if replay is None else round(replay, 3),
            floor_ms=round(floor_ms, 3), x_floor=round(step_ms / floor_ms, 3),
            copy_bandwidth_gbps=round(bandwidth),
        )  # fmt: skip
        print(ROW + json.dumps(row), flush=True)


def run_worker(kv_cache_dtype: str, cases: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """This script again, in a new process, for one KV dtype: its rows."""
    spec = ",".join(f"{b}x{c}" for b, c in cases)  # the last --cases given is the one used
    cmd = [sys.executable, "-m", "bench.bench_fp8_decode", *sys.argv[1:], "--cases", spec]
    cmd += ["--worker", kv_cache_dtype]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    lines = proc.stdout.splitlines()
    return [json.loads(line[len(ROW) :]) for line in lines if line.startswith(ROW)]


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--cases", help="only these, e.g. 1x4096,64x4096")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--worker", choices=KV_DTYPES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cpu":
        args.shape = "tiny-llama"
    cases = CPU_CASES if args.device == "cpu" else CASES
    if args.cases:
        cases = [(int(b), int(c)) for b, c in (x.split("x") for x in args.cases.split(","))]
    if args.worker:
        worker(args, args.worker, cases)
        return
    rows: list[dict[str, Any]] = []
    by_case: dict[tuple[int, int], dict[str, float]] = {}
    for kv in KV_DTYPES:
        mine = [c for c in cases if kv != "auto" or c not in FP8_ONLY]
        for row in run_worker(kv, mine):
            by_case.setdefault((row["batch"], row["context"]), {})[kv] = row["overlap_ms"]
            rows.append(row)
    for row in rows:
        times = by_case[(row["batch"], row["context"])]
        both = row["kv_cache_dtype"] == "fp8_e4m3" and "auto" in times
        row["fp8_vs_bf16"] = round(times["fp8_e4m3"] / times["auto"], 3) if both else None
        print("DECODE-FP8", row, flush=True)
    model = f"{args.shape} shapes, random bf16 weights, bf16 or FP8 KV, page 16"
    if args.device == "cpu":
        model += ", CPU smoke test (torch backend, eager)"
    write_result(args.out, "decode-fp8", rows, model=model)


if __name__ == "__main__":
    main()
