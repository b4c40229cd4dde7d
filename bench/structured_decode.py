"""Decode step time with a JSON-schema constraint on every request against none, and the schema's
compile time: what structured outputs cost a decoding batch (goal: at most 5% at batch 64).

Random weights (`--shape`, bf16), one GPU. `engine_ms` is the real `Engine.step()` loop (overlap
scheduling, CUDA graphs) on `batch` requests prefilled to `context` tokens, as in
`bench.bench_decode`; the constrained run gives every request the same schema, whose shortest
valid output is far longer than the steps timed, so no request ends meanwhile. A constrained
step fills the rows' token bitmask on the host while the forward runs, copies it to the device,
applies it to the logits and samples from them (the graph's own argmax is not used).

    python -m bench.structured_decode --tokenizer-dir DIR [--shape llama3-8b] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.bench_decode import engine_ms
from bench.gpu_common import bench_parser, decode_config, engine_run, wall_ms
from bench.results_io import write_result
from workers.engine.engine import Engine
from workers.protocol import SamplingParams, StructuredOutputs
from workers.sampling.grammar import compile_matcher, vocab_tokenizer

CASES = [(1, 1024), (16, 1024), (64, 1024)]
ROUNDS = 3
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "status": {"enum": ["open", "closed", "draft"]},
        "items": {
            "type": "array",
            "minItems": 20,  # at least ~200 tokens: longer than the steps timed
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 16},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["id", "name", "price"],
            },
        },
    },
    "required": ["items", "title", "status"],
}


def compile_ms(engine: Engine) -> tuple[float, float, float]:
    """Milliseconds to build llguidance's tokenizer view, to compile the schema (cold), and
    to copy the compiled matcher (what a cached spec costs a request)."""
    vocab = engine.runner.model_config.vocab_size
    start = time.perf_counter()
    tokenizer = vocab_tokenizer(engine.tokenizer, vocab)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    spec = StructuredOutputs(json_schema=SCHEMA)
    cold = wall_ms(lambda: compile_matcher(spec, tokenizer), warmup=1, iters=5)
    matcher = compile_matcher(spec, tokenizer)
    return tokenizer_ms, cold, wall_ms(matcher.deep_copy, warmup=1, iters=20)


def main() -> None:
    ap = bench_parser(__doc__)
    args = ap.parse_args()
    engine = Engine(decode_config(args, CASES))
    engine.runner.pool.pages.normal_()  # attend over random KV, never zeros
    tokenizer_ms, cold_ms, cached_ms = compile_ms(engine)
    print(f"llguidance tokenizer {tokenizer_ms:.0f} ms; schema compile {cold_ms:.2f} ms cold, "
          f"{cached_ms:.3f} ms cached", flush=True)  # fmt: skip
    schema = StructuredOutputs(json_schema=json.dumps(SCHEMA))
    rows = [dict(case="compile", tokenizer_ms=tokenizer_ms, cold_ms=cold_ms, cached_ms=cached_ms)]
    for batch, context in CASES:
        # alternated rounds, each side's median: a step moves by ~10% between runs of a few
        # hundred steps (clocks, the host), more than the difference measured
        times: dict[bool, list[float]] = {False: [], True: []}
        run = engine_run(batch, context, engine.cfg.max_num_batched_tokens)
        constrained = SamplingParams(
            temperature=0.0, max_tokens=run, ignore_eos=True, structured_outputs=schema
        )
        for _ in range(ROUNDS):
            for masked_run in (False, True):
                params = constrained if masked_run else None
                times[masked_run].append(engine_ms(engine, batch, context, params))
        torch.cuda.synchronize()
        plain, masked = statistics.median(times[False]), statistics.median(times[True])
        ratio = masked / plain
        print(f"batch {batch:3d} x {context}: {plain:.3f} ms plain, {masked:.3f} ms with a JSON "
              f"schema on every request: x{ratio:.3f}", flush=True)  # fmt: skip
        rows.append(
            dict(
                case=f"decode {batch}x{context}",
                shape=args.shape,
                batch=batch,
                context=context,
                plain_ms=round(plain, 3),
                constrained_ms=round(masked, 3),
                x_plain=round(ratio, 3),
            )
        )
    write_result(
        args.out,
        "structured-decode",
        rows,
        model=f"{args.shape} shapes, random bf16 weights; llguidance",
        title="Decode step with a JSON-schema constraint on every request",
    )


if __name__ == "__main__":
    main()
