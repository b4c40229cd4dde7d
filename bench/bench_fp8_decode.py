"""Decode step with an FP8 KV cache against bf16 KV, each against its own floor.

Random Llama-3-8B weights in bf16 on one GPU; the KV pool in bf16 (`kv_cache_dtype=auto`) and
then in FP8 (`fp8_e4m3`), each engine in a process of its own (one H200 holds either pool at its
largest case, not both). Per case (batch x context) and KV dtype: the overlapped step
(`bench_decode.overlapped_ms`, the engine's pipelining without its scheduler), the CUDA graph
replay and, for the goal's case, the engine's own loop (`bench_decode.engine_ms`, the median of
`--repeats` runs, each recorded; the step the ratios use where it was measured, as in
`bench_decode`), against the floor: the weights once
plus the sequences' KV bytes (half with FP8) at the copy rate measured in the same process.
`fp8_vs_bf16` is the FP8 step over the bf16 step of the same case, measured in the same run.
256 x 4096 runs in FP8 only: its bf16 KV (128 GiB) and the weights exceed one H200, its FP8 KV
(64 GiB) does not. Goal: FP8 at 64 x 4096 within 1.15x its floor. FP8 decode graphs read the
pool with the kernel the GPU's table picks per batch size (the Triton kernel
`kernels/fp8_decode.py` or FlashInfer's XQA, `attention/xqa_decode.py`);
`--fp8-kernels triton,xqa` runs the FP8 engine once per kernel instead. `--kv auto,int8` picks
the KV dtypes (the default `auto,fp8_e4m3`): `int8` is the cache of a float32 scale per token
and head (`kvcache/int8_rows.py`, read in decode graphs by `kernels/int8_decode.py`), its floor
the same weights plus its `head_dim + 4` bytes a row; each non-bf16 row gets `<dtype>_vs_bf16`
where bf16 ran in the same call.

`--attention`: the attention alone instead, per layer (Llama-3-8B heads, page 16, FP8 KV, a
CUDA graph over enough layers that L2 holds none of it): the Triton kernel against FlashInfer's
FP8 decode (tensor cores, as the engine plans it), each against the floor of reading the FP8
K/V once at the copy rate measured in the same run (`gpu_common.Floor`, as every benchmark);
the data behind `fp8_decode.FLASHINFER_FASTER`. XQA too (`xqa_us`). `--sweep` adds the Triton
kernel's launch choices (tile, warps, stages, splits of each sequence) and XQA's splits, and
reports the fastest of each per case; `--write-table` writes them as this GPU's table
(`workers/kernels/tables/fp8_decode_<GPU>.json`, `tuning.py`): the Triton launches, and XQA
where it was at least 5% faster. `--attention --kv int8`: the same kernel over int8 rows
against their floor, its sweep's fastest written as the table's `"int8"` launches.

    python -m bench.bench_fp8_decode --tokenizer-dir DIR [--out DIR] [--cases 1x4096,64x4096]
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --fp8-kernels triton,xqa
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --cases 64x4096 --kv auto,int8
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --attention [--sweep [--write-table]]
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --attention --kv int8 [--sweep ...]
    python -m bench.bench_fp8_decode --tokenizer-dir DIR --device cpu   # smoke test: tiny shape
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from bench.bench_decode import decode_step, engine_ms, fill_random, overlapped_ms
from bench.gpu_common import (
    Floor,
    add_repeats_argument,
    bench_parser,
    cuda_ms,
    decode_config,
    median_of,
    replay_ms,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result
from workers.kernels.tuning import (
    FP8DecodeLaunch,
    dumps_fp8_decode,
    fp8_decode_table,
    int8_decode_launches,
    table_path,
    with_int8_launches,
    xqa_programs,
    xqa_table,
)
from workers.protocol import INT8_SCALE_BYTES

CASES = [(1, 4096), (16, 4096), (64, 4096), (256, 2048), (256, 4096)]
FP8_ONLY = {(256, 4096)}
CPU_CASES = [(1, 64), (4, 128)]  # --device cpu: the tiny shape, a smoke test of the mechanics
ENGINE_CASES = {(64, 4096), (4, 128)}  # the engine's own loop too (its prefill takes a while)
KV_DTYPES = ("auto", "fp8_e4m3", "int8")
ROW = "FP8ROW "  # a worker's result line
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16  # --attention: Llama-3-8B's heads
# 2 warps too: the int8 kernel's fastest on an H100, and the FP8 kernel's SM90 build at 64-token
# tiles issues 2,490 warp instructions a tile at 2 warps against 2,229 at 1 and 2,960 at 4.
SWEEP = dict(tile=(64, 128), num_warps=(1, 2, 4), stages=(3,), splits=(1, 2, 4, 8, 16, 32))
# An H100 swept 64 x 4096 over 64- and 128-token tiles and 2-8 warps: 64 tokens and 2 warps
# fastest (281 us), 4 warps 1.36x, 8 warps and 128 tokens at 2 warps 2.2-5x.
SWEEP_INT8 = dict(tile=(32, 64), num_warps=(1, 2, 4), stages=(2, 3), splits=(1, 2, 4))
XQA_SPLITS = (1, 2, 4, 8, 16, 32)
# XQA's FP8 products cost precision (on random data; not measurably on SmolLM2's decode steps):
# the table takes it only where it is at least 5% faster than the Triton kernel's best.
XQA_MARGIN = 0.95


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
    engine = Engine(decode_config(args, cases, **fields))
    runner = engine.runner
    fill_random(runner.pool.pages, runner.kv_layout.head_dim)
    floor = Floor(cpu_copy_gbps()) if cpu else Floor.measure()
    kv_per_token = runner.kv_layout.page_bytes // runner.cfg.page_size
    for batch, context in cases:
        step = decode_step(runner, batch, context)
        step_ms = overlapped_ms(runner, step, iters=5 if cpu else 30)
        replay = None
        if runner.graphs is not None:
            replay = replay_ms(runner.graphs.graphs[batch].replay)
        runs = []  # the goal's figure: --repeats runs of the engine loop
        if (batch, context) in ENGINE_CASES:
            runs = [round(engine_ms(engine, batch, context), 3) for _ in range(args.repeats)]
        in_engine = median_of(runs) if runs else None
        nbytes = weight_bytes_read(runner, batch) + batch * context * kv_per_token
        best = step_ms if in_engine is None else in_engine
        row = dict(
            kv_cache_dtype=kv_cache_dtype, batch=batch, context=context,
            kv_gib=round(batch * context * kv_per_token / 2**30, 2),
            engine_ms=in_engine, engine_ms_runs=runs or None,
            overlap_ms=round(step_ms, 3),
            graph_replay_ms=None if replay is None else round(replay, 3),
            **floor.columns(nbytes, best),
            x_floor_runs=[floor.columns(nbytes, r)["x_floor"] for r in runs] or None,
            copy_bandwidth_gbps=round(floor.copy_gbps),
        )  # fmt: skip
        print(ROW + json.dumps(row), flush=True)


def step(row: dict[str, Any]) -> float:
    """A row's decode step: the engine's own loop where it was measured, else the overlapped one
    (`bench_decode` reads its rows the same way)."""
    return row["engine_ms"] if row.get("engine_ms") is not None else row["overlap_ms"]


def run_worker(
    kv_cache_dtype: str, cases: list[tuple[int, int]], kernel: str | None = None
) -> list[dict[str, Any]]:
    """This script again, in a new process, for one KV dtype (and FP8 decode kernel): its
    rows, each naming the kernel ("table": the GPU's table picks)."""
    spec = ",".join(f"{b}x{c}" for b, c in cases)  # the last --cases given is the one used
    cmd = [sys.executable, "-m", "bench.bench_fp8_decode", *sys.argv[1:], "--cases", spec]
    cmd += ["--worker", kv_cache_dtype]
    if kernel:
        cmd += ["--set", f"kernels.fp8_decode_kernel={kernel}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    lines = proc.stdout.splitlines()
    rows = [json.loads(line[len(ROW) :]) for line in lines if line.startswith(ROW)]
    if kv_cache_dtype == "fp8_e4m3":
        for row in rows:
            row["fp8_decode_kernel"] = kernel or "table"
    return rows


def row_bytes(int8: bool) -> int:
    """A (token, head) row of K or V: FP8 values, or int8 values and their float32 scale."""
    return HEAD_DIM + INT8_SCALE_BYTES if int8 else HEAD_DIM


def attention_graph(
    batch: int, context: int, run: Callable[..., object], int8: bool = False
) -> tuple[Callable[[], object], int]:
    """A CUDA graph of `run(q, layer_kv, indptr, indices, last)` over enough layers of random
    FP8 K/V (int8 rows with `int8`), each its own, that L2 holds none: its replay, and the
    number of layers."""
    pages_per_seq = math.ceil(context / PAGE)
    layer_bytes = batch * context * 2 * KV_HEADS * row_bytes(int8)
    layers = max(1, min(32, math.ceil(2**30 / layer_bytes)))
    shape = (batch * pages_per_seq, 2, PAGE, KV_HEADS, row_bytes(int8))
    pools = []
    for _ in range(layers):
        pool = torch.empty(shape, dtype=torch.int8 if int8 else torch.float8_e4m3fn, device="cuda")
        fill_random(pool, HEAD_DIM, pages_at_once=4096)
        pools.append(pool)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    indices = torch.randperm(batch * pages_per_seq, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_seq - 1) * PAGE, dtype=torch.int32)
    meta = (indptr, indices, last)
    for pool in pools:  # warm-up (compiles, plans) outside the capture
        run(q, pool, *meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for pool in pools:
            run(q, pool, *meta)
    return graph.replay, layers


def kernel_run(
    batch: int, launch: FP8DecodeLaunch | None = None, splits: int | None = None,
    int8: bool = False,
) -> Callable[..., object]:  # fmt: skip
    """The kernel with `launch` and `splits` (by default as the GPU's table has them), over FP8
    pages or, with `int8`, int8 rows."""
    from workers.kernels.fp8_decode import FP8Decode
    from workers.kernels.int8_decode import Int8Decode

    kind = Int8Decode if int8 else FP8Decode
    kernel = kind(batch, Q_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, torch.device("cuda"),
                  launch, splits)  # fmt: skip
    forward: Callable[..., object] = kernel.forward
    scales = () if int8 else (0.5, 2.0)  # FP8's per-layer K and V scales; int8 rows carry theirs
    device_meta: list[torch.Tensor] = []

    def run(q: torch.Tensor, kv: torch.Tensor, *meta: torch.Tensor) -> object:
        if not device_meta:
            device_meta.extend(m.cuda() for m in meta)
        return forward(q, kv, *device_meta, *scales)

    return run


def flashinfer_run(batch: int) -> Callable[..., object]:
    import flashinfer

    from workers.attention.flashinfer import new_workspace

    wrapper: list[Any] = []

    def run(q: torch.Tensor, kv: torch.Tensor, *meta: torch.Tensor) -> object:
        if not wrapper:
            buffers = [m.cuda() for m in meta]
            wrapper.append(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                new_workspace(q.device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=buffers[0], paged_kv_indices_buffer=buffers[1],
                paged_kv_last_page_len_buffer=buffers[2],
            ))  # fmt: skip
            wrapper[0].plan(*meta, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, sm_scale=HEAD_DIM**-0.5,
                            q_data_type=torch.bfloat16, kv_data_type=kv.dtype)  # fmt: skip
        return wrapper[0].run(q, kv, k_scale=0.5, v_scale=2.0)

    return run


def xqa_run(batch: int, splits: int | None = None) -> Callable[..., object]:
    """FlashInfer's XQA (`attention/xqa_decode.py`), `splits` of each sequence (by default as
    the GPU's table has them, else for ~1024 programs)."""
    from workers.attention.xqa_decode import XQABuffers, XQADecode
    from workers.kernels.split_kv_common import num_splits

    if splits is None:
        programs = xqa_programs(batch, torch.cuda.get_device_name()) or 1024
        splits = num_splits(batch, KV_HEADS, programs)
    kernel: list[XQADecode] = []

    def run(q: torch.Tensor, kv: torch.Tensor, *meta: torch.Tensor) -> object:
        if not kernel:
            indptr, indices, last = meta
            pages = int(indptr[1] - indptr[0])  # every sequence has as many
            buffers = XQABuffers(batch, pages, q.device)
            kernel.append(XQADecode(batch, Q_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, PAGE,
                                    q.dtype, buffers, splits))  # fmt: skip
            lens = (indptr[1:] - indptr[:-1] - 1) * PAGE + last
            kernel[0].plan(indices.view(batch, pages).cuda(), lens.to(torch.int32))
        return kernel[0].forward(q, kv, 0.5, 2.0)

    return run


def layer_us(batch: int, context: int, run: Callable[..., object], int8: bool = False) -> float:
    replay, layers = attention_graph(batch, context, run, int8)
    us = cuda_ms(replay, warmup=3, iters=20) * 1e3 / layers
    torch.cuda.empty_cache()
    return us


def sweep_launches(
    batch: int, context: int, space: dict[str, tuple[int, ...]], row: dict[str, Any],
    int8: bool = False,
) -> tuple[tuple[FP8DecodeLaunch, int], float]:  # fmt: skip
    """The kernel at every (tile, warps, stages, splits) of `space`, each printed: the fastest
    launch and splits, and its µs a layer (set in `row`, rounded, as best_us with best_launch)."""
    timed = {}
    for values in itertools.product(*space.values()):
        tile, num_warps, stages, splits = values
        launch = FP8DecodeLaunch(tile=tile, num_warps=num_warps, stages=stages)
        timed[values] = layer_us(batch, context, kernel_run(batch, launch, splits, int8), int8)
        print(f"SWEEP{'-INT8' if int8 else ''} {batch}x{context} {launch} splits={splits}: "
              f"{timed[values]:.2f} us", flush=True)  # fmt: skip
    best = min(timed, key=timed.__getitem__)
    row["best_us"] = round(timed[best], 2)
    row["best_launch"] = ",".join(f"{k}={v}" for k, v in zip(space, best))
    return (FP8DecodeLaunch(*best[:3]), best[3]), timed[best]


def attention(args: argparse.Namespace, cases: list[tuple[int, int]]) -> None:
    """The attention alone: the kernel (and with --sweep its launch choices) against
    FlashInfer's FP8 decode, per layer."""
    from workers.kernels import fp8_decode

    floor = Floor.measure()
    rows = []
    winners: dict[tuple[int, int], tuple[FP8DecodeLaunch, int]] = {}
    xqa_winners: dict[tuple[int, int], int] = {}  # XQA's splits where it is the faster, else 0
    for batch, context in cases:
        kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM
        row: dict[str, Any] = dict(batch=batch, context=context)
        row["kernel_us"] = round(layer_us(batch, context, kernel_run(batch)), 2)
        row["flashinfer_us"] = round(layer_us(batch, context, flashinfer_run(batch)), 2)
        row["xqa_us"] = round(layer_us(batch, context, xqa_run(batch)), 2)
        if args.sweep:
            winners[batch, context], best_us = sweep_launches(batch, context, SWEEP, row)
            xqa_timed = {n: layer_us(batch, context, xqa_run(batch, n)) for n in XQA_SPLITS}
            print(f"SWEEP {batch}x{context} xqa splits: {xqa_timed}", flush=True)
            splits = min(xqa_timed, key=xqa_timed.__getitem__)
            row["xqa_best_us"], row["xqa_best_splits"] = round(xqa_timed[splits], 2), splits
            faster = xqa_timed[splits] < XQA_MARGIN * best_us
            xqa_winners[batch, context] = splits if faster else 0
        row.update(floor.columns(kv_bytes, row["kernel_us"], unit="us"))
        row["flashinfer_x_floor"] = floor.columns(kv_bytes, row["flashinfer_us"], "us")["x_floor"]
        row["xqa_x_floor"] = floor.columns(kv_bytes, row["xqa_us"], "us")["x_floor"]
        row["kernel_used"] = fp8_decode.used_at(batch)
        print("FP8-ATTENTION", row, flush=True)
        rows.append(row)
    if args.write_table:
        gpu = torch.cuda.get_device_name()
        xqa = xqa_table(xqa_winners, KV_HEADS)
        text = dumps_fp8_decode(fp8_decode_table(winners, KV_HEADS), xqa, gpu,
                                int8_decode_launches(gpu))  # the int8 launches kept  # fmt: skip
        table_path(gpu, "fp8_decode").write_text(text)
        print(f"launch table {table_path(gpu, 'fp8_decode')}:\n{text}", flush=True)
    model = "Llama-3-8B attention heads (32/8, d128), page 16, FP8 KV, one layer's time"
    write_result(args.out, "decode-fp8-attention", rows, model=model, measured=floor.measured())


def attention_int8(args: argparse.Namespace, cases: list[tuple[int, int]]) -> None:
    """The attention alone over int8 rows (`kernels/int8_decode.py`), per layer, against the
    floor of reading its rows once; with --sweep its launch choices, and with --write-table the
    fastest as the `"int8"` launches of this GPU's table (its FP8 entries kept)."""
    floor = Floor.measure()
    rows = []
    winners: dict[tuple[int, int], tuple[FP8DecodeLaunch, int]] = {}
    for batch, context in cases:
        kv_bytes = batch * context * 2 * KV_HEADS * row_bytes(int8=True)
        row: dict[str, Any] = dict(batch=batch, context=context)
        row["kernel_us"] = round(layer_us(batch, context, kernel_run(batch, int8=True), True), 2)
        if args.sweep:
            winners[batch, context], _ = sweep_launches(batch, context, SWEEP_INT8, row, True)
            row["best_x_floor"] = floor.columns(kv_bytes, row["best_us"], "us")["x_floor"]
        row.update(floor.columns(kv_bytes, row["kernel_us"], unit="us"))
        print("INT8-ATTENTION", row, flush=True)
        rows.append(row)
    if args.write_table:
        gpu = torch.cuda.get_device_name()
        text = with_int8_launches(gpu, fp8_decode_table(winners, KV_HEADS))
        table_path(gpu, "fp8_decode").write_text(text)
        print(f"launch table {table_path(gpu, 'fp8_decode')}:\n{text}", flush=True)
    model = "Llama-3-8B attention heads (32/8, d128), page 16, int8 KV rows, one layer's time"
    write_result(args.out, "decode-int8-attention", rows, model=model, measured=floor.measured())


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--cases", help="only these, e.g. 1x4096,64x4096")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    add_repeats_argument(ap)
    ap.add_argument("--worker", choices=KV_DTYPES, help=argparse.SUPPRESS)
    ap.add_argument("--attention", action="store_true", help="the attention alone, per layer")
    ap.add_argument("--sweep", action="store_true", help="--attention: the kernel's launches")
    ap.add_argument("--fp8-kernels", help="FP8 decode kernels to run in turn, e.g. triton,xqa "
                    "(default: the GPU's table picks)")  # fmt: skip
    ap.add_argument("--kv", default="auto,fp8_e4m3",
                    help="KV dtypes to run in turn, of " + ",".join(KV_DTYPES))  # fmt: skip
    ap.add_argument("--write-table", action="store_true",
                    help="--sweep: write the fastest launches as this GPU's table")  # fmt: skip
    args = ap.parse_args()
    if args.device == "cpu":
        args.shape = "tiny-llama"
    cases = CPU_CASES if args.device == "cpu" else CASES
    if args.cases:
        cases = [(int(b), int(c)) for b, c in (x.split("x") for x in args.cases.split(","))]
    if args.worker:
        worker(args, args.worker, cases)
        return
    if args.attention:
        attention_int8(args, cases) if args.kv == "int8" else attention(args, cases)
        return
    rows: list[dict[str, Any]] = []
    bf16_ms: dict[tuple[int, int], float] = {}
    kernels = args.fp8_kernels.split(",") if args.fp8_kernels else [None]
    kv_dtypes = args.kv.split(",")
    if unknown := set(kv_dtypes) - set(KV_DTYPES):
        ap.error(f"--kv: unknown {sorted(unknown)}; choose of {KV_DTYPES}")
    runs = [(kv, k) for kv in kv_dtypes for k in (kernels if kv == "fp8_e4m3" else [None])]
    for kv, kernel in runs:
        mine = [c for c in cases if kv != "auto" or c not in FP8_ONLY]
        for row in run_worker(kv, mine, kernel):
            if kv == "auto":
                bf16_ms[row["batch"], row["context"]] = step(row)
            rows.append(row)
    for row in rows:
        bf16 = bf16_ms.get((row["batch"], row["context"]))
        kv = row["kv_cache_dtype"]
        if kv != "auto":
            name = "fp8" if kv == "fp8_e4m3" else kv
            row[f"{name}_vs_bf16"] = round(step(row) / bf16, 3) if bf16 else None
        print("DECODE-FP8", row, flush=True)
        print(f"{kv} {row['batch']}x{row['context']}: step {step(row):.3f} ms, "
              f"{row['x_floor']}x its floor", flush=True)  # fmt: skip
    model = f"{args.shape} shapes, random bf16 weights, {' / '.join(kv_dtypes)} KV, page 16"
    if args.device == "cpu":
        model += ", CPU smoke test (torch backend, eager)"
    write_result(args.out, "decode-fp8", rows, model=model)


if __name__ == "__main__":
    main()
