"""FlashInfer's decode attention alone, per layer, in the ways it can be planned: against the floor
of reading the step's K/V once.

A decode step attends once per layer; at batch 1 × 1024 (Llama-3-8B: 8 KV heads × 128, page 16)
a layer reads 4 MiB of K/V, ~1 µs at HBM speed, while the engine's profile shows ~10 µs (the
kernel, then the merge of its KV splits). Each variant is captured as a CUDA graph of one
attention per layer over the model's 32 layers, each layer its own K/V (so L2 holds none of it),
as the decode graph runs them.

    python -m bench.bench_decode_attention [--cases 1x1024,16x1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import flashinfer
import torch

from bench.gpu_common import Floor, cuda_ms
from bench.results_io import add_out_argument, write_result
from workers.attention.flashinfer import new_workspace

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 32, 8, 128, 16  # Llama-3-8B

# name -> (wrapper options, plan options); the engine runs "tensor cores" (a group of 4).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tensor cores": (dict(use_tensor_cores=True), {}),
    "tensor cores, one split": (dict(use_tensor_cores=True), dict(disable_split_kv=True)),
    "tensor cores, fa3": (dict(use_tensor_cores=True, backend="fa3"), {}),
    "CUDA cores": (dict(use_tensor_cores=False), {}),
    "CUDA cores, one split": (dict(use_tensor_cores=False), dict(disable_split_kv=True)),
}


def layer_graph(
    batch: int, context: int, wrapper_opts: dict[str, Any], plan_opts: dict[str, Any]
) -> Callable[[], object]:
    """A replayable graph of one decode attention per layer, planned for `batch` × `context`."""
    pages_per_seq = math.ceil(context / PAGE)
    num_pages = batch * pages_per_seq
    pools = [
        torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    indices = torch.randperm(num_pages, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_seq - 1) * PAGE, dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        new_workspace(torch.device("cuda")),
        "NHD",
        use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr.cuda(),
        paged_kv_indices_buffer=indices.cuda(),
        paged_kv_last_page_len_buffer=last.cuda(),
        **wrapper_opts,
    )
    wrapper.plan(
        indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **plan_opts,
    )  # fmt: skip
    for pool in pools:  # warm-up (and any JIT) outside the capture
        wrapper.run(q, pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for pool in pools:
            wrapper.run(q, pool)
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1x1024,1x4096,16x1024,64x2048")
    add_out_argument(ap)
    args = ap.parse_args()
    floor = Floor.measure()
    print(f"copy bandwidth {floor.copy_gbps:.0f} GB/s (read + write, 4 GiB)")
    print(
        f"{'batch × context':>15} {'variant':>24} {'µs a layer':>10} {'floor µs':>8} {'× floor':>7}"
    )
    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * 2
        floor_us = floor.columns(kv_bytes, 1.0, unit="us")["floor_us"]
        row: dict[str, Any] = dict(batch=batch, context=context)
        for name, (wrapper_opts, plan_opts) in VARIANTS.items():
            try:
                replay = layer_graph(batch, context, wrapper_opts, plan_opts)
            except Exception as e:  # a variant this FlashInfer build cannot plan or compile
                print(f"{case:>15} {name:>24} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            us = cuda_ms(replay, warmup=3, iters=20) * 1e3 / LAYERS
            print(f"{case:>15} {name:>24} {us:10.2f} {floor_us:8.2f} {us / floor_us:7.1f}")
            row[name.replace(",", "").replace(" ", "_").lower() + "_us"] = round(us, 2)
            torch.cuda.empty_cache()
        engine_us = row.get("tensor_cores_us")  # the engine's variant
        if engine_us:
            row.update(floor.columns(kv_bytes, engine_us, unit="us"))
        rows.append(row)
    model = "Llama-3-8B attention heads, page 16, a CUDA graph of 32 layers"
    write_result(args.out, "decode-attention", rows, model=model, measured=floor.measured())


if __name__ == "__main__":
    main()
