"""Decode-step GEMMs: cuBLAS (F.linear) against the Triton skinny GEMM, Llama-3-8B shapes.

    python -m bench.bench_gemm_decode [--out DIR] [--tp N]

For each weight (q/k/v, o_proj, gate_up, down, LM head) and M in 1..64 rows: weight GB/s of
each, its fraction of the measured device copy bandwidth, the speedup, and whether
`workers/model/layers.py` dispatches to the kernel there (`skinny_gemm.applies`). Then gate_up
with its SiLU x up (`gemm-decode-gated`): the one gated launch against the GEMM then
`fused.silu_and_mul`. The totals are
one decode step's GEMM time: the four layer weights x 32 plus the LM head. `--tp N`: one rank's
shards at N tensor-parallel ranks instead (q/k/v, gate_up and the LM head split N, o_proj and
down split K).

Every call reads its own copy of the weight from a set larger than the L2 (as a decode step
reads each weight once), and calls are timed as CUDA-graph replays, as the engine runs decode,
so launch overhead on the host is not counted. `bench/sweep_skinny_gemm.py` times launch configs
the same way and writes the GPU's launch table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.gpu_common import copy_bandwidth_gbps, cuda_ms
from bench.results_io import add_out_argument, write_result

# name -> (N, K), bf16, Llama-3-8B unsharded
SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYERS = 32
ROWS = (1, 2, 4, 8, 16, 32, 64)
WORKING_SET = 256 * 2**20  # > 4x the H200's 60 MB L2
ROW_SPLIT = ("o_proj", "down")  # RowParallelLinear: TP splits K; the others split N


def shard_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of one rank's shard of each weight at `tp` ranks."""
    return {
        name: (n, k // tp) if name in ROW_SPLIT else (n // tp, k) for name, (n, k) in SHAPES.items()
    }


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(1, -(-WORKING_SET // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]


def graph_ms(fn: Callable[[torch.Tensor], object], ws: list[torch.Tensor]) -> float:
    """Milliseconds per call of `fn(w)`, replayed in a CUDA graph over every copy in `ws`."""
    calls = [ws[i % len(ws)] for i in range(max(8, len(ws)))]
    for w in ws:  # compile and initialise outside the capture
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in calls:
            fn(w)
    return cuda_ms(graph.replay, warmup=3, iters=20) / len(calls)


def compare(shapes: dict[str, tuple[int, int]], copy_gbps: float) -> list[dict]:
    from workers.kernels import skinny_gemm

    rows = []
    print(
        f"{'shape':8} {'M':>3} {'cuBLAS ms':>10} {'GB/s':>6} {'of copy':>7} "
        f"{'Triton ms':>10} {'GB/s':>6} {'of copy':>7} {'speedup':>7}  used"
    )
    for name, (n, k) in shapes.items():
        ws = weights(n, k)
        gb = n * k * 2 / 1e9
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_ms(lambda w, x=x: F.linear(x, w), ws)
            triton_ms = graph_ms(lambda w, x=x: skinny_gemm.skinny_linear(x, w), ws)
            used = skinny_gemm.applies(m, ws[0])
            row = dict(shape=name, m=m, cublas_ms=cublas, triton_ms=triton_ms, used=used)
            rows.append(row)
            print(
                f"{name:8} {m:>3} {cublas:10.4f} {gb / cublas * 1e3:6.0f} "
                f"{gb / cublas * 1e3 / copy_gbps:7.1%} {triton_ms:10.4f} "
                f"{gb / triton_ms * 1e3:6.0f} {gb / triton_ms * 1e3 / copy_gbps:7.1%} "
                f"{cublas / triton_ms:7.2f}x  {'yes' if used else 'no'}"
            )
        del ws
    return rows


def gated(n: int, k: int, alone: list[dict]) -> list[dict]:
    """gate_up ([n, k]) with its activation, per M: cuBLAS or the skinny GEMM then
    `fused.silu_and_mul`, against the one gated launch; `alone`: `compare`'s rows, for the
    skinny GEMM without the activation; `used`: where the layers take the gated launch."""
    from workers.kernels import fused, skinny_gemm

    ws = weights(n, k)
    plain = {r["m"]: r["triton_ms"] for r in alone if r["shape"] == "gate_up"}
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = graph_ms(lambda w, x=x: fused.silu_and_mul(F.linear(x, w)), ws)
        unfused = graph_ms(lambda w, x=x: fused.silu_and_mul(skinny_gemm.skinny_linear(x, w)), ws)
        one = graph_ms(lambda w, x=x: skinny_gemm.skinny_linear(x, w, gated=True), ws)
        rows.append(dict(
            m=m, cublas_then_silu_us=round(cublas * 1e3, 1),
            skinny_then_silu_us=round(unfused * 1e3, 1), gated_us=round(one * 1e3, 1),
            gated_vs_skinny_then_silu=round(one / unfused, 3),
            gate_up_alone_us=round(plain[m] * 1e3, 1),
            used=skinny_gemm.applies(m, ws[0], gated=True),
        ))  # fmt: skip
        print(f"gate_up+silu {rows[-1]}")
    return rows


def step_totals(rows: list[dict]) -> None:
    """One decode step's GEMMs: 32 layers of q/k/v, o_proj, gate_up, down, plus the LM head."""
    for m in ROWS:
        at = {r["shape"]: r for r in rows if r["m"] == m}
        count = {name: (1 if name == "lm_head" else LAYERS) for name in at}
        cublas = sum(at[s]["cublas_ms"] * c for s, c in count.items())
        triton_ms = sum(at[s]["triton_ms"] * c for s, c in count.items())
        dispatch = sum(
            (at[s]["triton_ms"] if at[s]["used"] else at[s]["cublas_ms"]) * c
            for s, c in count.items()
        )
        print(
            f"step GEMMs M={m:<3} cuBLAS {cublas:6.3f} ms  Triton {triton_ms:6.3f} ms  "
            f"as dispatched {dispatch:6.3f} ms  ({cublas / dispatch:.3f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_argument(ap)
    ap.add_argument("--tp", type=int, default=1, help="one rank's shards at this many ranks")
    args = ap.parse_args()
    shapes = shard_shapes(args.tp)
    copy_gbps = copy_bandwidth_gbps()
    weight_gb = sum(n * k * 2 * (1 if s == "lm_head" else LAYERS) for s, (n, k) in shapes.items())
    print(f"device copy bandwidth {copy_gbps:.0f} GB/s; step weights {weight_gb / 1e9:.2f} GB")
    model = "Llama-3-8B shapes" + (f", one rank's shards at TP {args.tp}" if args.tp > 1 else "")
    measured = dict(copy_bandwidth_gbps=round(copy_gbps))
    with torch.inference_mode():
        rows = compare(shapes, copy_gbps)
    step_totals(rows)
    write_result(args.out, "gemm-decode", rows, model=model, measured=measured)
    if "gate_up" in shapes:
        with torch.inference_mode():
            act = gated(*shapes["gate_up"], rows)
        write_result(args.out, "gemm-decode-gated", act, model=model, measured=measured,
                     title="gate_up with its SiLU: one gated launch against the GEMM, then "
                     "the activation")  # fmt: skip


if __name__ == "__main__":
    main()
