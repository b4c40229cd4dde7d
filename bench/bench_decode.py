"""Decode step time against the HBM floor: random weights, bf16, one GPU or a TP group.

A step is what the engine runs per generated token on `batch` sequences of `context` tokens
each. Its floor is the bytes it must read, the weights once (of the embedding only the batch's
rows, unless tied to the LM head) plus every sequence's KV, over the copy bandwidth measured in
the same process (`gpu_common.Floor`, which also gives it over the datasheet's rate); with
`--tp N` each rank reads its shard of both in parallel, so the floor is one
rank's bytes (the all-reduces between the ranks are part of the gap). Three ways of timing it:
- `engine_ms`: the real `Engine.step()` loop (overlap scheduling, scheduler, detokeniser, stop
  checks) on `batch` requests that have been prefilled to `context` tokens: wall time per step,
  the median of `--repeats` runs (default 3; every run in `engine_ms_runs`);
- `overlap_ms`: `ModelRunner.launch` of step n+1 before reading step n, back to back;
- `sync_ms`: `ModelRunner.execute`, which waits for each step (the engine without overlap).
Parts are timed too: the graph replay (forward, LM head and argmax; replays queued back to
back between CUDA events, `gpu_common.replay_ms`; one GPU only: a rank cannot replay its graph
alone), the host's input plan and FlashInfer's plan, and the
eager step. `x_roofline` sets the step against a second bound, each GEMM at the slower of
its weight read and its FLOPs at the bf16 GEMM peak measured in the same run (large batches'
GEMMs are compute-bound: there the byte floor is out of any kernel's reach). `--profile` adds,
for 1x1024 and 64x2048 (or the `--cases` given), where the graph replay's device time goes
(with `--tp`, a whole step's on rank 0) and the top kernels and host ops of an eager step;
`--trace DIR` also writes each profiled replay as a Chrome trace (every kernel's start and end:
a layer's critical path, kernel by kernel).

    python -m bench.bench_decode --tokenizer-dir DIR [--shape llama3-8b] [--tp 2] [--out DIR]
        [--profile [--trace DIR]] [--set kernels.pdl=false ...]
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from bench.gpu_common import (
    ENGINE_STEPS,
    ENGINE_WARMUP,
    PAGE_SIZE,
    Floor,
    add_repeats_argument,
    bench_parser,
    decode_config,
    engine_run,
    gemm_peak_tflops,
    median_of,
    replay_ms,
    roofline_columns,
    step_timeline,
    top_kernels,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result
from workers.engine.engine import Engine
from workers.engine.model_runner import ModelRunner
from workers.kvcache.int8_rows import INT8_MAX
from workers.protocol import GenerateRequest, SamplingParams
from workers.scheduler.step import StepInput
from workers.sequence import Sequence

# (batch, context). 256 x 4096 is left out: 128 GiB of Llama-3-8B KV plus 16 GB of weights
# exceed one H200.
CASES = [(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024), (64, 2048), (64, 4096)]
CASES += [(256, 1024), (256, 2048)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
ENGINE_CASES = {(1, 1024), (16, 1024), (64, 2048), (256, 1024)}  # prefilling all cases is slow


def fill_random(pages: torch.Tensor, head_dim: int, pages_at_once: int = 1024) -> None:
    """Random KV in a pool (attention over zeros would be no test), a slice of pages at a time:
    FP8 has no `normal_`, and one bf16 copy of a 64 GiB pool would not fit beside it. int8 rows
    get random values and one fixed scale (random bytes would make scales NaN or huge;
    quantizing random rows would take a float32 rotation of the whole pool)."""
    scale = torch.tensor([2 / INT8_MAX], device=pages.device).view(torch.int8)  # |x| <= 2
    for start in range(0, pages.shape[0], pages_at_once):
        part = pages[start : start + pages_at_once]
        if part.dtype == torch.int8:
            part[..., :head_dim].random_(-INT8_MAX, INT8_MAX + 1)
            part[..., head_dim:] = scale
        else:
            part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=part.device))


def decode_step(runner: ModelRunner, batch: int, context: int) -> StepInput:
    """`batch` sequences of `context` tokens whose last token is the one to compute."""
    ps = runner.cfg.page_size
    pages_per_seq = -(-context // ps)
    rng = random.Random(batch * 100_003 + context)
    seqs = []
    for i in range(batch):
        ids = [rng.randrange(1000, 30000) for _ in range(context)]
        seq = Sequence(f"s{i}", ids, context - 1, GREEDY, None)
        seq.pages = list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    return StepInput(seqs, [1] * batch)


def overlapped_ms(runner: ModelRunner, step: StepInput, iters: int = 30) -> float:
    """Milliseconds per step when each step is launched before the previous one is read."""
    prev = runner.launch(step)
    for _ in range(3):
        prev.result()
        prev = runner.launch(step)
    start = time.perf_counter()
    for _ in range(iters):
        launched = runner.launch(step)
        prev.result()
        prev = launched
    prev.result()
    return (time.perf_counter() - start) * 1e3 / iters


def engine_ms(
    engine: Engine, batch: int, context: int, params: SamplingParams | None = None
) -> float:
    """Wall milliseconds per `Engine.step()` once `batch` random prompts of `context` tokens
    are prefilled and decoding (greedy, unless `params`, which must outlast the steps: at least
    `engine_run` tokens). Raises if a timed step ran fewer than `batch` sequences."""
    rng = random.Random(batch + context)
    run = engine_run(batch, context, engine.cfg.max_num_batched_tokens)
    params = params or SamplingParams(temperature=0.0, max_tokens=run, ignore_eos=True)
    for i in range(batch):
        ids = tuple(rng.randrange(1000, 30000) for _ in range(context))
        engine.add_request(GenerateRequest(request_id=f"e{i}", prompt_token_ids=ids, params=params))
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started |= {o.request_id for o in engine.step()}
    for _ in range(ENGINE_WARMUP):
        engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    scheduler = engine.scheduler
    preempted = scheduler.num_preemptions
    start = time.perf_counter()
    for _ in range(ENGINE_STEPS):
        engine.step()
    ms = (time.perf_counter() - start) * 1e3 / ENGINE_STEPS
    if len(scheduler.running) != batch or scheduler.num_preemptions != preempted:
        raise RuntimeError(f"the timed steps did not all run {batch} sequences: "
                           f"{len(scheduler.running)} left running, "
                           f"{scheduler.num_preemptions - preempted} preempted")  # fmt: skip
    for i in range(batch):
        engine.abort(f"e{i}")
    while engine.has_work():
        engine.step()
    return ms


def top_host_ops(fn: Callable[[], object], limit: int = 15) -> str:
    """The torch ops and CUDA runtime calls of `fn` that take the most host time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=limit, max_name_column_width=50
    )
    return f"host time of 5 graph steps, by op:\n{table}"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument(
        "--profile", action="store_true", help="top kernels of 1x1024, 64x2048 (or --cases)"
    )
    ap.add_argument("--cases", help="only these, e.g. 1x1024,64x2048")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    ap.add_argument("--trace", help="with --profile: a folder for Chrome traces of the replays")
    add_repeats_argument(ap)
    args = ap.parse_args()
    floor = Floor.measure()
    peak = gemm_peak_tflops()
    print(f"copy bandwidth {floor.copy_gbps:.0f} GB/s (read + write), bf16 GEMM peak "
          f"{peak:.0f} TFLOP/s", flush=True)  # fmt: skip
    cases = CASES
    profiled = [(1, 1024), (64, 2048)]
    if args.cases:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        profiled = cases
    page_size = PAGE_SIZE
    cfg = decode_config(args, cases, tensor_parallel_size=args.tp)  # pages for these alone
    engine = Engine(cfg)
    assert engine.overlap
    runner = engine.runner
    fill_random(runner.pool.pages, runner.kv_layout.head_dim)
    graphs = runner.graphs
    assert graphs is not None
    kv_per_token = runner.kv_layout.page_bytes // page_size
    rows = []
    for batch, context in cases:
        step = decode_step(runner, batch, context)
        sync_ms = wall_ms(lambda: runner.execute(step))  # noqa: B023 - called here only
        pipelined_ms = overlapped_ms(runner, step)
        # GPU time of the captured step
        replay = replay_ms(graphs.graphs[batch].replay) if args.tp == 1 else None
        plan_ms = wall_ms(lambda: runner.plan(step))  # noqa: B023 - host only
        _, _, batch_in = runner.device_inputs(runner.plan(step))
        fi_plan_ms = wall_ms(lambda: graphs.attn[batch].plan(batch_in))  # noqa: B023
        runner.graphs = None
        eager_ms = wall_ms(lambda: runner.execute(step), warmup=2, iters=5)  # noqa: B023
        runner.graphs = graphs
        runs = []  # the engine loop, the goal cases' figure: --repeats runs
        if (batch, context) in ENGINE_CASES:
            runs = [round(engine_ms(engine, batch, context), 3) for _ in range(args.repeats)]
        in_engine = median_of(runs) if runs else None
        nbytes = weight_bytes_read(runner, batch) + batch * context * kv_per_token
        best = in_engine if in_engine is not None else pipelined_ms
        against = floor.columns(nbytes, best)
        row = dict(
            shape=args.shape,
            tp=args.tp,
            batch=batch,
            context=context,
            engine_ms=in_engine,
            engine_ms_runs=runs or None,
            overlap_ms=round(pipelined_ms, 3),
            sync_ms=round(sync_ms, 3),
            graph_replay_ms=None if replay is None else round(replay, 3),
            host_plan_ms=round(plan_ms, 3),
            flashinfer_plan_ms=round(fi_plan_ms, 3),
            eager_step_ms=round(eager_ms, 3),
            **against,
            **roofline_columns(floor, peak, runner, nbytes, batch, best),
            x_floor_runs=[floor.columns(nbytes, r)["x_floor"] for r in runs] or None,
            replay_x_floor=None if replay is None else floor.columns(nbytes, replay)["x_floor"],
            tokens_per_s=round(batch / best * 1e3),
        )
        rows.append(row)
        print("DECODE", row, flush=True)
        if args.profile and args.tp > 1 and (batch, context) in profiled:
            # rank 0's device time of whole steps (a rank cannot replay its graph alone)
            print(step_timeline(lambda: runner.execute(step)), flush=True)  # noqa: B023
        elif args.profile and (batch, context) in profiled:
            trace = args.trace and f"{args.trace}/replay_{batch}x{context}.json"
            print(step_timeline(graphs.graphs[batch].replay, trace), flush=True)
            runner.graphs = None
            print(top_kernels(lambda: runner.execute(step)), flush=True)  # noqa: B023
            runner.graphs = graphs
            print(top_host_ops(lambda: runner.execute(step)), flush=True)  # noqa: B023
        torch.cuda.synchronize()
    name = "decode" if args.tp == 1 else f"decode-tp{args.tp}"
    model = f"{args.shape} shapes, random bf16 weights, page {page_size}, CUDA graphs"
    measured = dict(gemm_peak_tflops=round(peak), **floor.measured())
    write_result(args.out, name, rows, model=model, measured=measured)


if __name__ == "__main__":
    main()
