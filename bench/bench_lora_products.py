"""The LoRA products alone, per projection of a decode step: the SGMV kernels against the masked
dense products and against the floor of reading the adapters' A and B once.

Llama-3-8B's projections (q/k/v, o, gate/up, down), 8 slots of rank 16, a batch's tokens spread
round-robin over the slots (so every slot's A and B is read). Each variant is captured as a
CUDA graph of one projection's products per layer over 32 layers, each layer its own A and B
and rows (so L2 holds none of them), as the LoRA decode graph runs them. The floor: the slots'
A and B bytes, x read and y read and written once, at the copy rate measured in the same run.

    python -m bench.bench_lora_products [--batches 16 64] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_common import Floor, cuda_ms
from bench.results_io import add_out_argument, write_result
from workers.kernels.lora_ops import masked_add_lora
from workers.kernels.lora_sgmv import MAX_TOKENS, launch_choices, sgmv_add_lora

LAYERS, SLOTS, RANK = 32, 8, 16
PROJECTIONS = {  # name -> (input size, output parts): Llama-3-8B
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
VARIANTS: dict[str, Callable[..., torch.Tensor]] = dict(sgmv=sgmv_add_lora, masked=masked_add_lora)


def layer_tensors(tokens: int, n_in: int, out_parts: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: x, y, A, B and the one-hot slot mask (bf16, seeded)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dt, out = torch.bfloat16, sum(out_parts)
    mask = torch.zeros(tokens, SLOTS, device="cuda", dtype=dt)
    mask[torch.arange(tokens), torch.arange(tokens) % SLOTS] = 1.0
    layers: list[tuple[torch.Tensor, ...]] = []
    for _ in range(LAYERS):
        x = torch.randn(tokens, n_in, generator=gen, device="cuda").to(dt)
        y = torch.randn(tokens, out, generator=gen, device="cuda").to(dt)
        a = torch.randn(SLOTS, len(out_parts) * RANK, n_in, generator=gen, device="cuda")
        b = torch.randn(out, SLOTS, RANK, generator=gen, device="cuda")
        layers.append((x, y, (a / n_in**0.5).to(dt), (b / RANK**0.5).to(dt), mask))
    return layers


def replay(fn: Callable[..., torch.Tensor], layers: list[tuple[torch.Tensor, ...]],
           out_parts: list[int]) -> Callable[[], None]:  # fmt: skip
    """A replayable graph of `fn` over every layer's tensors."""
    for t in layers:  # warm-up (and Triton's compile) outside the capture
        fn(*t, out_parts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in layers:
            fn(*t, out_parts)
    return graph.replay


SHRINK_CHOICES = [dict(split_k=s, block_k=k, warps=4) for s in (256, 512, 1024) for k in (64, 128)]
EXPAND_CHOICES = [dict(block_n=n, warps=w) for n in (64, 128, 256) for w in (4, 8)]


def sgmv_us(layers: list[tuple[torch.Tensor, ...]], out_parts: list[int],
            choices: tuple[int, int, int, tuple[int, int]]) -> float:  # fmt: skip
    """µs a layer of the SGMV products with these launch choices (`launch_choices`' order)."""
    fn = functools.partial(sgmv_add_lora, choices=choices)
    return cuda_ms(replay(fn, layers, out_parts)) * 1e3 / LAYERS


def sweep(batches: list[int]) -> list[dict[str, Any]]:
    """The SGMV launch choices per projection and batch against the defaults (`default_us`):
    the shrink's (expand at 128 columns, 8 warps), then the expand's with the best shrink; each
    in a graph over the layers as above."""
    rows = []
    for tokens, (name, (n_in, out_parts)) in itertools.product(batches, PROJECTIONS.items()):
        timed = functools.partial(sgmv_us, layer_tensors(tokens, n_in, out_parts), out_parts)
        default = timed(launch_choices(tokens, n_in, sum(out_parts)))
        shrinks = {(c["split_k"], c["block_k"], c["warps"]): timed((
            c["split_k"], c["block_k"], 128, (c["warps"], 8))) for c in SHRINK_CHOICES}  # fmt: skip
        (split_k, block_k, w0), _ = min(shrinks.items(), key=lambda kv: kv[1])
        expands = {(c["block_n"], c["warps"]): timed((split_k, block_k, c["block_n"],
                   (w0, c["warps"]))) for c in EXPAND_CHOICES}  # fmt: skip
        (block_n, w1), best = min(expands.items(), key=lambda kv: kv[1])
        rows.append(dict(batch=tokens, projection=name, default_us=round(default, 2),
                         best_us=round(best, 2), split_k=split_k, block_k=block_k,
                         shrink_warps=w0, block_n=block_n, expand_warps=w1))  # fmt: skip
        print(rows[-1])
        del timed
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, MAX_TOKENS])
    ap.add_argument("--sweep", action="store_true", help="the SGMV launch choices instead")
    add_out_argument(ap)
    args = ap.parse_args()
    if args.sweep:
        model = f"Llama-3-8B projections, {SLOTS} slots of rank {RANK}, SGMV launch choices"
        title = "LoRA products: SGMV launch choices per projection and batch"
        write_result(args.out, "lora-products-sweep", sweep(args.batches), model=model, title=title)
        return
    floor = Floor.measure()
    print(f"copy bandwidth {floor.copy_gbps:.0f} GB/s")
    rows: list[dict[str, Any]] = []
    for tokens in args.batches:
        total: dict[str, float] = {"floor_us": 0.0}
        for name, (n_in, out_parts) in PROJECTIONS.items():
            layers = layer_tensors(tokens, n_in, out_parts)
            x, y, a, b, _ = layers[0]
            nbytes = a.nbytes + b.nbytes + x.nbytes + 2 * y.nbytes
            row: dict[str, Any] = dict(batch=tokens, projection=name)
            for label, fn in VARIANTS.items():
                us = cuda_ms(replay(fn, layers, out_parts)) * 1e3 / LAYERS
                row[f"{label}_us"] = round(us, 2)
                total[f"{label}_us"] = total.get(f"{label}_us", 0.0) + us
            row |= floor.columns(nbytes, row["sgmv_us"], unit="us")
            total["floor_us"] += row["floor_us"]
            rows.append(row)
            print(row)
            del layers
            torch.cuda.empty_cache()
        whole = {k: round(v, 2) for k, v in total.items()}
        rows.append(dict(batch=tokens, projection="all four", **whole,
                         x_floor=round(total["sgmv_us"] / total["floor_us"], 2)))  # fmt: skip
        print(rows[-1])
    model = f"Llama-3-8B projections, {SLOTS} slots of rank {RANK}, a CUDA graph of {LAYERS} layers"
    title = "LoRA products alone: SGMV and the masked products against their bytes' floor"
    write_result(args.out, "lora-products", rows, model=model, title=title,
                 measured=floor.measured())  # fmt: skip


if __name__ == "__main__":
    main()
