"""Sweep the skinny GEMM's launch configs on this GPU and write its launch table.

    python -m bench.sweep_skinny_gemm [--tp 1,2] [--table FILE] [--out DIR]
    python -m bench.sweep_skinny_gemm --shapes 5120,2048;2048,4096 --rows 1,8   # other models
    python -m bench.sweep_skinny_gemm --blocked   # GEMV tiles over blocked gate/up, one row

For each Llama-3-8B weight (`bench_gemm_decode.SHAPES`, or one rank's shards at each `--tp`;
or the [N, K] weights of `--shapes`) and M in 1..64 rows (or `--rows`), times every candidate
config and F.linear as CUDA-graph replays over copies of the weight larger than the L2
(`bench_gemm_decode.graph_ms`), and keeps the fastest config per (N, K, M bucket). A cell is a
win where that config beat F.linear by at least `WIN_MARGIN` on its own. The swept cells
replace theirs in the table at `--table`, by default the file the kernel loads for this GPU
(`workers/kernels/tuning.table_path`); `--out DIR` keeps every timing as a result
file. A sweep times
kernels alone: docs/notes/skinny-gemm-tuning.md tells which H200 cells were then re-chosen
inside whole decode steps, and why.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_gemm_decode import ROWS, graph_ms, shard_shapes, weights
from bench.gpu_common import time_configs
from bench.results_io import add_out_argument, write_result
from workers.kernels.tuning import Cell, Config, SkinnyGemmTable, dumps, parse, table_path

WIN_MARGIN = 0.02  # below this the difference is within run-to-run noise


def candidates(m: int, n: int) -> list[Config]:
    splits = (1, 2, 4, 8) if n <= 8192 else (1, 2)
    out: list[Config] = []
    if m == 1:
        gemv = [(4, 512), (8, 512), (8, 256), (16, 256)]
        out += [Config(bn, bk, 4, split_k=s) for bn, bk in gemv for s in splits[:3]]
    swap = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)]
    plain = [] if m == 1 else [(32, 256, 4, 3), (32, 128, 4, 4)]
    out += [Config(bn, bk, w, st, True, True, s) for bn, bk, w, st in swap for s in splits]
    out += [Config(bn, bk, w, st, True, False, s) for bn, bk, w, st in plain for s in splits[:3]]
    return out


def sweep_shape(
    n: int, k: int, row_counts: list[int], rows: list[dict]
) -> tuple[dict[Cell, Config], set[Cell]]:
    """The fastest config per M of an [N, K] weight, and the cells where it wins."""
    from workers.kernels.skinny_gemm import skinny_linear

    configs: dict[Cell, Config] = {}
    wins: set[Cell] = set()
    ws = weights(n, k)
    for m in row_counts:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = graph_ms(lambda w, x=x: F.linear(x, w), ws)
        timed = time_configs(
            candidates(m, n),
            lambda c, x=x: graph_ms(lambda w: skinny_linear(x, w, config=c), ws),
            f"{n}x{k} M={m}",
        )
        best_ms, best = min(timed, key=lambda t: t[0])
        configs[(n, k, m)] = best
        if best_ms < (1 - WIN_MARGIN) * cublas:
            wins.add((n, k, m))
        print(f"{n}x{k} M={m:<3} F.linear {cublas:.4f} ms, best {best_ms:.4f} {best}", flush=True)
        rows.append(dict(n=n, k=k, m=m, linear_ms=cublas, all={repr(c): t for t, c in timed}))
    return configs, wins


def sweep_blocked(n: int = 28672, k: int = 4096) -> None:
    """The gated GEMV over a [gate; up] weight in blocks of rows at one row (the tiles of
    `skinny_gemm.BLOCKED_GEMV`), beside the table's row-major cell: prints each, writes nothing."""
    from workers.kernels.skinny_gemm import launch_config, skinny_linear
    from workers.kernels.weight_blocks import BLOCK_ROWS, block_rows

    ws = weights(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row_major = graph_ms(lambda w: skinny_linear(x, w, gated=True), ws)
    print(f"{n}x{k} M=1 gated, row-major {launch_config(1, ws[0], True)}: {row_major:.4f} ms")
    blocked: list[torch.Tensor] = []
    for w in ws:
        param = torch.nn.Parameter(w, requires_grad=False)
        block_rows(param, BLOCK_ROWS)
        blocked.append(param)
    configs = [Config(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
               for bn, bk, warps, stages in itertools.product((32, 64, 128), (16, 32, 64),
                                                              (1, 2, 4), (2, 3))]  # fmt: skip
    timed = time_configs(
        configs,
        lambda c: graph_ms(lambda w: skinny_linear(x, w, config=c, gated=True), blocked),
        f"{n}x{k} M=1 blocked",
    )
    for ms, cfg in sorted(timed, key=lambda t: t[0])[:8]:
        print(f"blocked {cfg}: {ms:.4f} ms ({ms / row_major:.3f}x row-major)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1", help="shards at these rank counts, e.g. 1,2")
    ap.add_argument("--shapes", help="';'-separated N,K weights instead of Llama-3-8B's")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values, e.g. 1,8")
    ap.add_argument("--table", type=Path, help="the table file (default: this GPU's)")
    ap.add_argument("--blocked", action="store_true", help="only the blocked gate/up GEMV")
    add_out_argument(ap)
    args = ap.parse_args()
    if args.blocked:
        with torch.inference_mode():
            sweep_blocked()
        return
    gpu = torch.cuda.get_device_name()
    if args.shapes:
        shapes = {tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")}
    else:
        shapes = {shape for tp in args.tp.split(",") for shape in shard_shapes(int(tp)).values()}
    row_counts = [int(m) for m in args.rows.split(",")]
    out = args.table or table_path(gpu)
    old = parse(json.loads(out.read_text())) if out.is_file() else None
    configs: dict[Cell, Config] = dict(old.configs) if old else {}
    wins: set[Cell] = set(old.wins) if old else set()
    rows: list[dict] = []
    with torch.inference_mode():
        for n, k in sorted(shapes):
            shape_configs, shape_wins = sweep_shape(n, k, row_counts, rows)
            configs.update(shape_configs)
            wins = (wins - shape_configs.keys()) | shape_wins
    out.write_text(dumps(SkinnyGemmTable(configs, frozenset(wins)), gpu))
    print(f"wrote {out} ({len(configs)} cells, {len(wins)} wins) for {gpu}")
    model = f"[N, K] weights {args.shapes}" if args.shapes else "Llama-3-8B shapes"
    write_result(args.out, "skinny-gemm-sweep", rows, model=model)


if __name__ == "__main__":
    main()
