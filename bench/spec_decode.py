"""Speculative decoding: accepted tokens per step and tokens/s on a repetitive workload, and the
verify step's cost against the plain decode step.

Two parts (`--part`, default both):
- `workload`: SmolLM2 (real weights; `--model`, default the embedded one) on a repetitive
  workload, one request at a time (batch 1): rewrite a passage word for word, and an edit of a
  piece of code that returns most of it. Greedy, the offline `LLM` without speculation (the
  reference, measured in the same run) and with ngram drafts for each k of `--ks` (and a draft
  model with `--draft-model`). Per run: tokens/s against the reference's (`x_reference`), the
  tokens a sequence gains per target step (`tokens_per_step`: 1 without speculation), the share
  of drafts accepted, and whether the tokens are the reference's (they must be). CPU or GPU.
- `verify`: `--shape` with random weights: the target step of `batch` sequences of `context`
  tokens, each verifying k drafts (k + 1 tokens a sequence), for k = 0 (the plain decode step)
  to 8, at batch 1 and 16; the decode step's HBM floor (weights and KV read once over the copy
  bandwidth, as `bench.bench_decode`); and from them the time per generated token that a
  per-token acceptance rate a buys: t(k) / E(k), E(k) = (1 - a^(k+1)) / (1 - a) tokens a step,
  and, with the workload part in the same run, at the tokens per step measured there (goal: at
  batch 1 with ngram, below the floor). A GPU, or `--set device=cpu` with `--shape tiny-llama`
  to check the script.

    python -m bench.spec_decode --tokenizer-dir DIR [--part workload|verify] [--ks 2,4,8]
        [--model GGUF_OR_DIR] [--draft-model DIR] [--max-tokens 128] [--out DIR] [--set ...]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.gpu_common import (
    PAGE_SIZE,
    bench_parser,
    copy_bandwidth_gbps,
    decode_config,
    wall_ms,
    weight_bytes_read,
)
from bench.results_io import write_result
from workers.config import DEFAULT_MODEL
from workers.engine.engine import Engine
from workers.engine.model_runner import ModelRunner
from workers.llm import LLM, GenerationOutput
from workers.protocol import SamplingParams
from workers.scheduler.step import StepInput
from workers.sequence import Sequence

PASSAGE = (
    "The old lighthouse stood at the end of the harbour wall. Every evening at dusk the keeper "
    "climbed its one hundred and twelve steps, trimmed the wick, wound the clockwork that turned "
    "the lens, and wrote the weather in his log: the wind, the state of the sea, the ships that "
    "passed. In forty years he missed one evening, the night his daughter was born, and the "
    "harbour master lit the lamp for him."
)
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''
WORKLOAD = {
    "rewrite": f"Repeat the following passage word for word, and nothing else.\n\n{PASSAGE}",
    "code_edit": "Rename the parameter `values` to `xs` everywhere in this code and return the "
    f"whole code.\n\n```python\n{CODE}```",
}
VERIFY_CASES = [(1, 1024), (16, 1024)]
MAX_K = 8
ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)


def tokens_per_step(k: int, a: float) -> float:
    """Expected tokens a sequence gains from a step verifying k drafts, each accepted with
    probability a (given the ones before it were)."""
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def run_workload(
    llm: LLM, params: SamplingParams
) -> tuple[dict[str, list[GenerationOutput]], float, float, int]:
    """Each workload prompt alone; its outputs, the wall and process CPU seconds (on a shared
    CPU the latter varies less with the other processes' load) and the target steps."""
    engine = llm.engine
    steps_before = engine.step_tokens.buckets[-1]
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = {name: llm.chat([{"role": "user", "content": text}], params)
            for name, text in WORKLOAD.items()}  # fmt: skip
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return outs, wall, cpu, engine.step_tokens.buckets[-1] - steps_before


def workload_rows(args: Any) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    model = args.model or DEFAULT_MODEL
    runs: list[tuple[str, int, dict[str, Any] | None]] = [("none", 0, None)]
    runs += [("ngram", k, {"method": "ngram", "num_speculative_tokens": k}) for k in args.ks]
    if args.draft_model:
        runs += [("draft_model", k, {"method": "draft_model", "num_speculative_tokens": k,
                                     "model": args.draft_model}) for k in args.ks]  # fmt: skip
    rows: list[dict[str, Any]] = []
    reference: dict[str, list[GenerationOutput]] = {}
    ref_tps = ref_cpu = 0.0
    for method, k, spec in runs:
        # a small KV pool: each run's engine is built while the last one's may still hold its own
        llm = LLM(model, speculative=spec, **{"kv_cache_memory_gb": 2.0, **args.engine})
        llm.generate("Hello", SamplingParams(max_tokens=4))  # warm up
        outs, seconds, cpu_s, steps = run_workload(llm, params)
        flat = [o for v in outs.values() for o in v]
        tokens = sum(len(o.token_ids) for o in flat)
        drafted = sum(o.num_draft_tokens for o in flat)
        accepted = sum(o.num_accepted_tokens for o in flat)
        if not reference:
            reference, ref_tps, ref_cpu = outs, tokens / seconds, tokens / cpu_s
        same = all(o.token_ids == r.token_ids for n in outs for o, r in zip(outs[n], reference[n]))
        chunk = llm.engine.cfg.max_num_batched_tokens  # a prompt's prefill steps come first
        decode_steps = steps - sum(-(-len(o.prompt_token_ids) // chunk) for o in flat)
        row = dict(
            method=method,
            k=k,
            output_tokens=tokens,
            wall_s=round(seconds, 3),
            tokens_per_s=round(tokens / seconds, 2),
            reference_tokens_per_s=round(ref_tps, 2),
            x_reference=round(tokens / seconds / ref_tps, 3),
            tokens_per_cpu_s=round(tokens / cpu_s, 2),
            x_reference_cpu=round(tokens / cpu_s / ref_cpu, 3),
            tokens_per_step=round((tokens - len(flat)) / max(decode_steps, 1), 3),
            acceptance_rate=round(accepted / drafted, 3) if drafted else None,
            same_tokens_as_reference=same,
        )
        print("WORKLOAD", row, flush=True)
        rows.append(row)
        llm.close()
        del llm
    return rows


def verify_step(runner: ModelRunner, batch: int, context: int, k: int) -> StepInput:
    """`batch` sequences of `context` tokens whose last token and k drafts after it are to be
    computed (k = 0: a plain decode step)."""
    pages_per_seq = -(-(context + k) // PAGE_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_K + 2, ignore_eos=True)
    seqs = []
    for i in range(batch):
        ids = [1000 + (i * 7919 + t * 104729) % 29000 for t in range(context)]
        seq = Sequence(f"s{i}", ids, context - 1, greedy, None)
        seq.pages = list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))
        seq.num_computed_tokens = context - 1
        seq.draft_ids = ids[:k]
        seqs.append(seq)
    return StepInput(seqs, [1 + k] * batch)


def verify_rows(args: Any, workload: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cases = [(b * (k + 1), c + MAX_K) for b, c in VERIFY_CASES for k in range(MAX_K + 1)]
    engine = Engine(decode_config(args, cases))
    runner = engine.runner
    runner.pool.pages.normal_()
    cuda = runner.device.type == "cuda"
    bandwidth = copy_bandwidth_gbps() if cuda else None
    kv_per_token = runner.kv_layout.page_bytes // PAGE_SIZE
    measured = {r["k"]: r["tokens_per_step"] for r in workload if r["method"] == "ngram"}
    rows = []
    for batch, context in VERIFY_CASES:
        base_ms = None
        floor_ms = None
        if bandwidth is not None:
            nbytes = weight_bytes_read(runner, batch) + batch * context * kv_per_token
            floor_ms = nbytes / bandwidth / 1e6
        for k in range(MAX_K + 1):
            step = verify_step(runner, batch, context, k)
            ms = wall_ms(lambda: runner.execute(step), args.warmup, args.iters)  # noqa: B023
            base_ms = base_ms if base_ms is not None else ms
            row: dict[str, Any] = dict(
                batch=batch, context=context, k=k, step_ms=round(ms, 3),
                decode_step_ms=round(base_ms, 3), x_decode_step=round(ms / base_ms, 3),
                floor_ms=None if floor_ms is None else round(floor_ms, 3),
            )  # fmt: skip
            for a in ACCEPTANCE:
                per_token = ms / tokens_per_step(k, a)
                row[f"ms_per_token_a{int(a * 100)}"] = round(per_token, 3)
                row[f"tokens_per_s_a{int(a * 100)}"] = round(batch * 1e3 / per_token)
            if k in measured:  # the workload's tokens per step with ngram at this k
                per_token = ms / measured[k]
                row["ms_per_token_workload"] = round(per_token, 3)
                if floor_ms is not None:
                    row["workload_x_floor"] = round(per_token / floor_ms, 3)
            print("VERIFY", row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--part", choices=["workload", "verify", "all"], default="all")
    ap.add_argument("--ks", default="2,4,8", help="ngram (and draft model) k values")
    ap.add_argument("--model", help="SmolLM2's weights for the workload (default: embedded)")
    ap.add_argument("--draft-model", help="also run the workload with this draft model")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    from bench.gpu_common import engine_options

    args.engine = engine_options(args)
    workload = workload_rows(args) if args.part in ("workload", "all") else []
    if workload:
        write_result(
            args.out,
            "spec-decode-workload",
            workload,
            model=f"{Path(args.model).name if args.model else DEFAULT_MODEL}, greedy, batch 1",
            title="Speculative decoding: a repetitive workload on SmolLM2",
        )
    if args.part in ("verify", "all"):
        write_result(
            args.out,
            "spec-decode-verify",
            verify_rows(args, workload),
            model=f"{args.shape} shapes, random bf16 weights",
            title="Speculative decoding: the verify step against the decode step",
        )


if __name__ == "__main__":
    main()
