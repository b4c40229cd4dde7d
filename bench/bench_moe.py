"""MoE decode and prefill against their ceilings: random bf16 weights at Qwen3-30B-A3B's shapes.

Decode (batch 1 and 64, 1024 tokens of context each): a step's time against its floor, the bytes
it must read over the copy rate measured in the same run (`gpu_common.Floor`): every weight but
the experts (of the embedding only the batch's rows), the experts the batch routes to in each
layer (counted from the step's own routing) and every sequence's KV. Timed as the engine runs
it: each step launched before the previous one is read, on its CUDA graph (`overlap_ms`), and
the graph's replays alone (`graph_replay_ms`).
Prefill (one prompt of 8192 tokens): against the bf16 GEMM peak measured in the same run,
counting active-parameter FLOPs: 2 per weight per token for attention's projections, the
router and the k routed experts' three matrices, causal attention, and the LM head once.
Each figure is the median of `--repeats` runs (each run recorded).

    python bench/bench_moe.py --device cuda --out DIR [--tokenizer-dir DIR] [--repeats 3]
        [--profile [--trace DIR]]   # where each decode graph's device time goes, by kernel
    python bench/bench_moe.py --device cpu      # smoke: a tiny MoE in float32, no ceilings
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench_decode import decode_step, overlapped_ms  # noqa: E402
from bench.bench_prefill import prefill_step  # noqa: E402
from bench.gpu_common import (  # noqa: E402
    PAGE_SIZE,
    Floor,
    add_repeats_argument,
    bench_parser,
    dummy_model_dir,
    embedded_model_dir,
    engine_options,
    gemm_peak_tflops,
    median_of,
    replay_ms,
    step_timeline,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine.model_runner import ModelRunner  # noqa: E402
from workers.model.config import ModelConfig  # noqa: E402
from workers.model.moe import Router  # noqa: E402
from workers.scheduler.step import StepInput  # noqa: E402

DECODE = {"cuda": [(1, 1024), (64, 1024)], "cpu": [(1, 32), (4, 32)]}  # (batch, context)
PREFILL = {"cuda": 8192, "cpu": 64}
SHAPE = {"cuda": "qwen3-30b-a3b", "cpu": "tiny-moe"}


def routed_expert_bytes(runner: ModelRunner, step: StepInput) -> tuple[int, list[int]]:
    """Bytes of the experts `step` routes to (each read once), and how many a layer, from one
    eager run of the step with the routers observed."""
    per_layer: list[int] = []

    def seen(module: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
        per_layer.append(int(out[1].unique().numel()))

    routers = [m for m in runner.model.modules() if isinstance(m, Router)]
    hooks = [r.register_forward_hook(seen) for r in routers]
    graphs, runner.graphs = runner.graphs, None
    try:
        runner.execute(step)
    finally:
        runner.graphs = graphs
        for h in hooks:
            h.remove()
    cfg = runner.model_config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * runner.dtype.itemsize
    return sum(per_layer) * per_expert, per_layer


def all_expert_bytes(runner: ModelRunner) -> int:
    names = (".experts.w13", ".experts.w2")
    return sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
               if n.endswith(names))  # fmt: skip


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Active-parameter FLOPs of one prompt of `tokens` tokens (no cached prefix)."""
    d, hq, hkv, h = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    attn = h * (hq + 2 * hkv) * d + hq * d * h
    sparse = h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    dense = 3 * h * cfg.intermediate_size
    mlps = sum(sparse if cfg.is_sparse_layer(i) else dense for i in range(cfg.num_layers))
    linear = 2 * tokens * (attn * cfg.num_layers + mlps)
    attention = 4 * hq * d * tokens * (tokens + 1) / 2 * cfg.num_layers
    return linear + attention + 2 * cfg.vocab_size * h


def main() -> None:
    ap = bench_parser(__doc__, tokenizer_dir=embedded_model_dir())
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    add_repeats_argument(ap)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="each decode graph's and the prefill's kernels by kind",
    )
    ap.add_argument("--trace", help="with --profile: a folder for Chrome traces of the replays")
    args = ap.parse_args()
    dev, cuda = args.device, args.device == "cuda"
    shape = SHAPE[dev] if args.shape == "llama3-8b" else args.shape  # bench_parser's default
    cases, prompt = DECODE[dev], PREFILL[dev]
    pages = max(max(b * -(-(c + 64) // PAGE_SIZE) for b, c in cases), -(-prompt // PAGE_SIZE)) + 1
    cfg = EngineConfig(**engine_options(
        args, model=str(dummy_model_dir(shape, args.tokenizer_dir, args.work)),
        load_format="dummy", device=dev, dtype="bfloat16" if cuda else "float32",
        page_size=PAGE_SIZE, num_kv_pages=pages, max_num_batched_tokens=max(prompt, 256),
        max_num_seqs=max(b for b, _ in cases),
        cuda_graph_batch_sizes=tuple(b for b, _ in cases) if cuda else (),
    ))  # fmt: skip
    runner = ModelRunner(cfg)
    floor = Floor.measure() if cuda else None
    peak = gemm_peak_tflops() if cuda else None
    kv_per_token = runner.kv_layout.page_bytes // PAGE_SIZE
    experts_total = all_expert_bytes(runner)
    rows = []
    for batch, context in cases:
        step = decode_step(runner, batch, context)
        routed, per_layer = routed_expert_bytes(runner, step)
        runs = [round(overlapped_ms(runner, step), 3) for _ in range(args.repeats)]
        ms = median_of(runs)
        nbytes = (weight_bytes_read(runner, batch) - experts_total + routed
                  + batch * context * kv_per_token)  # fmt: skip
        graph = runner.graphs.graphs[batch] if runner.graphs is not None else None
        replay = round(replay_ms(graph.replay), 3) if graph is not None else None
        row = dict(kind="decode", shape=shape, batch=batch, context=context, overlap_ms=ms,
                   overlap_ms_runs=runs, graph_replay_ms=replay, bytes_read=nbytes,
                   experts_routed_per_layer=round(sum(per_layer) / len(per_layer), 1),
                   **(floor.columns(nbytes, ms) if floor else {}),
                   replay_x_floor=floor.columns(nbytes, replay)["x_floor"]
                   if floor and replay else None)  # fmt: skip
        rows.append(row)
        print("DECODE", row, flush=True)
        if args.profile and graph is not None:
            trace = args.trace and f"{args.trace}/moe_replay_{batch}x{context}.json"
            print(step_timeline(graph.replay, trace), flush=True)
    step = prefill_step(runner, 1, prompt)
    runs = [round(wall_ms(lambda: runner.execute(step), warmup=1, iters=3), 2)
            for _ in range(args.repeats)]  # fmt: skip
    ms = median_of(runs)
    tflops = prefill_flops(runner.model_config, prompt) / ms / 1e9
    row = dict(kind="prefill", shape=shape, tokens=prompt, step_ms=ms, step_ms_runs=runs,
               active_tflops=round(tflops, 1),
               of_gemm_peak=round(tflops / peak, 3) if peak else None)  # fmt: skip
    rows.append(row)
    print("PREFILL", row, flush=True)
    if args.profile and cuda:
        trace = args.trace and f"{args.trace}/moe_prefill_{prompt}.json"
        print(step_timeline(lambda: runner.execute(step), trace), flush=True)
    measured = dict(gemm_peak_tflops=round(peak), **floor.measured()) if floor and peak else None
    model = f"{shape} shapes, random {'bf16' if cuda else 'float32'} weights, page {PAGE_SIZE}"
    title = "MoE decode against the routed-expert floor, prefill against the GEMM peak"
    write_result(args.out, "moe", rows, model=model, title=title, measured=measured)


if __name__ == "__main__":
    main()
