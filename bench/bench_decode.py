"""Decode step time against the HBM floor: random weights, bf16, one GPU.

A step is what the engine runs per generated token: `ModelRunner.execute` on `batch` sequences
of `context` tokens each (host preparation, a CUDA-graph replay or the eager forward, logits,
greedy sampling, the read of the sampled ids). Its floor is the bytes it must read, the weights
once (of the embedding only the batch's rows, unless tied to the LM head) plus every sequence's
KV, over the copy bandwidth measured in the same process. Parts of the step are timed too: the
graph replay and the LM head + argmax on the GPU (CUDA events), the host's input preparation
and attention plan; `--profile` adds the top kernels and the top host ops of two cases.

    python -m bench.bench_decode --tokenizer-dir DIR [--shape llama3-8b] [--json out.json]
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from bench.gpu_common import (
    bench_parser,
    copy_bandwidth_gbps,
    cuda_ms,
    dummy_model_dir,
    top_kernels,
    wall_ms,
    write_json,
)
from workers.config import EngineConfig
from workers.engine import ModelRunner, StepInput
from workers.protocol import SamplingParams
from workers.sequence import Sequence

# (batch, context). 256 x 4096 is left out: 128 GiB of Llama-3-8B KV plus 16 GB of weights
# exceed one H200.
CASES = [(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024), (64, 2048), (64, 4096)]
CASES += [(256, 1024), (256, 2048)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


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


def weight_bytes_read(runner: ModelRunner, batch: int) -> int:
    params = {p.data_ptr(): p for p in runner.model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    cfg = runner.model_config
    if not cfg.tie_word_embeddings:  # the table is only gathered from: `batch` rows
        embed = runner.model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size() - batch * cfg.hidden_size * 2
    return total


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
    ap.add_argument("--profile", action="store_true", help="top kernels of eager 1x1024, 64x2048")
    args = ap.parse_args()
    bandwidth = copy_bandwidth_gbps()
    print(f"copy bandwidth {bandwidth:.0f} GB/s (read + write)", flush=True)
    page_size = 16
    pages = max(b * -(-c // page_size) for b, c in CASES) + 1
    cfg = EngineConfig(
        model=str(dummy_model_dir(args.shape, args.tokenizer_dir, args.work)),
        load_format="dummy",
        dtype="bfloat16",
        page_size=page_size,
        num_kv_pages=pages,
        max_num_seqs=256,
        cuda_graph_batch_sizes=tuple(sorted({b for b, _ in CASES})),
    )
    runner = ModelRunner(cfg)
    runner.pool.pages.normal_()  # attend over random KV, never zeros
    graphs = runner.graphs
    assert graphs is not None
    kv_per_token = runner.kv_layout.page_bytes // page_size
    rows = []
    for batch, context in CASES:
        step = decode_step(runner, batch, context)
        step_ms = wall_ms(lambda: runner.execute(step))  # noqa: B023 - called here only
        replay_ms = cuda_ms(graphs.graphs[batch].replay)  # GPU time of the captured forward
        hidden = graphs.outputs[batch][:batch]
        logits_ms = cuda_ms(lambda: runner.model.compute_logits(hidden).argmax(-1))  # noqa: B023
        _, _, batch_in = runner._prepare(step, batch)
        prepare_ms = wall_ms(lambda: runner._prepare(step, batch))  # noqa: B023 - host only
        plan_ms = wall_ms(lambda: graphs.attn[batch].plan(batch_in))  # noqa: B023
        runner.graphs = None
        eager_ms = wall_ms(lambda: runner.execute(step), warmup=2, iters=5)  # noqa: B023
        runner.graphs = graphs
        nbytes = weight_bytes_read(runner, batch) + batch * context * kv_per_token
        floor_ms = nbytes / bandwidth / 1e6
        row = dict(
            shape=args.shape,
            batch=batch,
            context=context,
            step_ms=round(step_ms, 3),
            graph_replay_ms=round(replay_ms, 3),
            logits_argmax_ms=round(logits_ms, 3),
            host_prepare_ms=round(prepare_ms, 3),
            host_plan_ms=round(plan_ms, 3),
            eager_step_ms=round(eager_ms, 3),
            floor_ms=round(floor_ms, 3),
            x_floor=round(step_ms / floor_ms, 3),
            tokens_per_s=round(batch / step_ms * 1e3),
        )
        rows.append(row)
        print("DECODE", row, flush=True)
        if args.profile and (batch, context) in ((1, 1024), (64, 2048)):
            runner.graphs = None
            print(top_kernels(lambda: runner.execute(step)), flush=True)  # noqa: B023
            runner.graphs = graphs
            print(top_host_ops(lambda: runner.execute(step)), flush=True)  # noqa: B023
        torch.cuda.synchronize()
    write_json(args.json, dict(copy_bandwidth_gbps=bandwidth, rows=rows))


if __name__ == "__main__":
    main()
