"""Prefill throughput against the bf16 GEMM peak: random weights, bf16, one GPU.

A step is `ModelRunner.execute` over whole prompts (no cached prefix). 1 x 8192 and 16 x 512
tokens: against an 8192^3 bf16 matmul measured in the same process, counting 2 FLOPs per weight
per token for every linear layer, causal attention (QK^T and PV: 4 * heads * head_dim per
query-key pair, half the square) and the LM head for the last token of each prompt.
1 x 32 and 1 x 256 tokens, a chat turn's time to first token: against reading the weights once
at the copy rate measured in the same process, `gpu_common.Floor` (GEMMs that thin wait on
their weights), as the engine runs them (on a decode CUDA graph, one row a token) and eagerly.

    python -m bench.bench_prefill --tokenizer-dir DIR [--shape llama3-8b] [--out DIR]
"""

from __future__ import annotations

import random

from bench.gpu_common import (
    Floor,
    bench_parser,
    dummy_model_dir,
    engine_options,
    gemm_peak_tflops,
    top_kernels,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result
from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.model.config import ModelConfig
from workers.protocol import SamplingParams
from workers.scheduler.step import StepInput
from workers.sequence import Sequence

CASES = [(1, 8192), (16, 512)]  # (prompts, tokens each)
SHORT_CASES = [(1, 32), (1, 256)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def prefill_flops(cfg: ModelConfig, prompts: int, tokens: int) -> float:
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    per_layer = cfg.hidden_size * (hq + 2 * hkv) * d + hq * d * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    linear = 2 * per_layer * cfg.num_layers * prompts * tokens
    pairs = prompts * tokens * (tokens + 1) / 2
    attention = 4 * hq * d * pairs * cfg.num_layers
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size * prompts
    return linear + attention + lm_head


def prefill_step(runner: ModelRunner, prompts: int, tokens: int) -> StepInput:
    ps = runner.cfg.page_size
    pages = -(-tokens // ps)
    rng = random.Random(prompts * 7 + tokens)
    seqs = []
    for i in range(prompts):
        ids = [rng.randrange(1000, 30000) for _ in range(tokens)]
        seq = Sequence(f"p{i}", ids, tokens, GREEDY, None)
        seq.pages = list(range(1 + i * pages, 1 + (i + 1) * pages))
        seqs.append(seq)
    return StepInput(seqs, [tokens] * prompts)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of 1 x 8192")
    args = ap.parse_args()
    peak = gemm_peak_tflops()
    print(f"bf16 GEMM peak {peak:.0f} TFLOP/s", flush=True)
    pages = max(n * -(-t // 16) for n, t in CASES) + 1
    cfg = EngineConfig(**engine_options(
        args,
        model=str(dummy_model_dir(args.shape, args.tokenizer_dir, args.work)),
        load_format="dummy",
        dtype="bfloat16",
        num_kv_pages=pages,
    ))  # fmt: skip
    runner = ModelRunner(cfg)
    rows = []
    for prompts, tokens in CASES:
        step = prefill_step(runner, prompts, tokens)
        ms = wall_ms(lambda: runner.execute(step), warmup=2, iters=7)  # noqa: B023
        tflops = prefill_flops(runner.model_config, prompts, tokens) / ms / 1e9
        row = dict(
            shape=args.shape,
            prompts=prompts,
            tokens=tokens,
            step_ms=round(ms, 2),
            tflops=round(tflops, 1),
            of_gemm_peak=round(tflops / peak, 3),
            tokens_per_s=round(prompts * tokens / ms * 1e3),
        )
        rows.append(row)
        print("PREFILL", row, flush=True)
        if args.profile and prompts == 1:
            print(top_kernels(lambda: runner.execute(step)), flush=True)  # noqa: B023
    floor = Floor.measure()
    for prompts, tokens in SHORT_CASES:
        step = prefill_step(runner, prompts, tokens)
        on_graph = runner.plan(step).graph
        ms = wall_ms(lambda: runner.execute(step), warmup=2, iters=10)  # noqa: B023
        graphs, runner.graphs = runner.graphs, None
        eager_ms = wall_ms(lambda: runner.execute(step), warmup=2, iters=10)  # noqa: B023
        runner.graphs = graphs
        against = floor.columns(weight_bytes_read(runner, prompts * tokens), ms)
        row = dict(shape=args.shape, prompts=prompts, tokens=tokens, step_ms=round(ms, 2),
                   on_graph=on_graph, eager_ms=round(eager_ms, 2), **against)  # fmt: skip
        rows.append(row)
        print("PREFILL", row, flush=True)
    measured = dict(gemm_peak_tflops=round(peak), **floor.measured())
    model = f"{args.shape} shapes, random bf16 weights, one step, no cached prefix"
    write_result(args.out, "prefill", rows, model=model, measured=measured)


if __name__ == "__main__":
    main()
