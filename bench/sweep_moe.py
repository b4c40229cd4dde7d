"""Tune the fused MoE kernel's launch table for this GPU: per expert shape and token bucket, time
each candidate `MoEConfig` (the aligned kernels' tiles; at small token counts the GEMV kernels'
too, then the down GEMV's own tiles beside the best gate/up ones) on random bf16 experts and
routing, and write the fastest to `workers/kernels/tables/moe_fused_<gpu>.json`
(`moe_tuning`), which `fused_moe` then reads.

    python bench/sweep_moe.py [--shapes 128,2048,768,8] [--tokens 1,2,...] [--write]

A shape is "experts on a rank, hidden, expert intermediate, top-k": Qwen3-30B-A3B's by default,
and its expert-parallel half (64 experts a rank); `--write` merges the results into the GPU's
table (without it, the table is printed). Each bucket's best is printed against the routed
experts' bytes at the copy rate measured in the same run, and against the other path's best.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu_common import Floor, cuda_ms, time_configs  # noqa: E402
from workers.kernels.moe_tuning import MoEConfig, MoETable, Shape, dumps, moe_table  # noqa: E402
from workers.kernels.tuning import table_path  # noqa: E402

SHAPES = "128,2048,768,8;64,2048,768,8"
TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"


def candidates(tokens: int, top_k: int, experts: int) -> list[MoEConfig]:
    """Tiles that fit: block_m at most a few times an expert's expected pairs. Where the pairs
    are at most the experts (twice `default_config`'s bound, so that the sweep finds where they
    stop winning), also the GEMV kernels' (`moe_gemv.py`) tiles: block_n 4 (the skinny GEMV's
    pick at M = 1) to 32 rows, block_k 128-512, 1-4 warps, 1-2 loop stages."""
    per_expert = max(1, tokens * top_k // experts)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)]
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        block_ms, (64, 128), (64, 128), (4, 8), (2, 3)
    ):
        if bm * bn >= 128 * 128 and warps == 4:  # large tiles: 8 warps only
            continue
        out.append(MoEConfig(bm, bn, bk, warps, stages))
    if tokens * top_k <= experts:
        slots = triton.next_power_of_2(top_k)  # the down kernel's slot rows, as gemv_moe pads
        for bn, bk, warps, stages, down_slots in itertools.product(
            (4, 8, 16, 32), (128, 256, 512), (1, 2, 4), (1, 2), (False, True)
        ):
            # gate's and up's [bn, bk] float32 accumulators (the down kernel's [slots x bn, bk]
            # with down_slots): 128 registers a thread at most
            if bn * bk > 2048 * warps or (down_slots and slots * bn * bk > 4096 * warps):
                continue
            out.append(MoEConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                 gemv=True, down_slots=down_slots))  # fmt: skip
    return out


def down_candidates(best: MoEConfig, top_k: int) -> list[MoEConfig]:
    """The GEMV path's `best` with the down kernel's own tiles (`MoEConfig.down`), either form:
    its reduction is over I, not H, so its best tiles need not be gate/up's."""
    slots = triton.next_power_of_2(top_k)
    out = []
    for bn, bk, warps, stages, down_slots in itertools.product(
        (2, 4, 8, 16), (64, 128, 256, 512), (1, 2, 4), (1, 2, 3), (False, True)
    ):
        rows = slots * bn if down_slots else bn  # its [rows, bk] float32 accumulator
        if rows * bk > 4096 * warps:
            continue
        out.append(dataclasses.replace(best, down_slots=down_slots,
                                       down=(bn, bk, warps, stages)))  # fmt: skip
    return out


def sweep(shape: Shape, token_counts: list[int], floor: Floor) -> dict[int, MoEConfig]:
    from workers.kernels.moe_fused import fused_moe

    E, H, inter, k = shape
    gen = torch.Generator("cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, generator=gen, device="cuda").bfloat16() / H**0.5
    w2 = torch.randn(E, H, inter, generator=gen, device="cuda").bfloat16() / inter**0.5
    best: dict[int, MoEConfig] = {}
    for tokens in token_counts:
        x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
        logits = torch.randn(tokens, E, generator=gen, device="cuda")
        weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)

        def ms_of(cfg: MoEConfig) -> float:
            return cuda_ms(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg))  # noqa: B023

        timed = time_configs(candidates(tokens, k, E), ms_of)
        ms, cfg = min(timed, key=lambda t: t[0])
        if cfg.gemv:  # then the down kernel's own tiles, gate/up's kept
            timed += time_configs(down_candidates(cfg, k), ms_of)
            ms, cfg = min(timed, key=lambda t: t[0])
        # against the routed experts' bytes at the copy rate, and the other path's best
        routed = int(ids.unique().numel()) * 3 * H * inter * w13.element_size()
        floor_ms = floor.columns(routed, ms)
        other = [t for t, c in timed if c.gemv != cfg.gemv]
        vs = f", the other path's best {min(other) / ms:.2f}x" if other else ""
        print(f"{shape} tokens={tokens}: {ms * 1e3:.1f} us ({floor_ms['x_floor']}x the routed "
              f"experts' floor{vs}) {cfg}", flush=True)  # fmt: skip
        best[tokens] = cfg
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="';'-separated E,H,I,top_k")
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--write", action="store_true", help="merge into the GPU's table file")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    table: MoETable = dict(moe_table(gpu))
    token_counts = [int(t) for t in args.tokens.split(",")]
    floor = Floor.measure()
    for spec in args.shapes.split(";"):
        e, h, i, k = (int(v) for v in spec.split(","))
        found = sweep((e, h, i, k), token_counts, floor)
        table[e, h, i, k] = {**table.get((e, h, i, k), {}), **found}
    text = dumps(table, gpu)
    if args.write:
        table_path(gpu, "moe_fused").write_text(text)
        print(f"wrote {table_path(gpu, 'moe_fused')}")
    else:
        print(text)


if __name__ == "__main__":
    main()
