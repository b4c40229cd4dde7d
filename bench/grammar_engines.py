"""xgrammar against llguidance, the two grammar engines structured outputs could use, with
SmolLM2's tokenizer: what choosing one costs per request and per step.

- compile: a typical JSON schema (an order: nested object, array of objects, enum, bounded
  numbers, optional fields) to a matcher, cold (each engine's caches emptied) and cached (a
  second request with the same schema: xgrammar's compiler cache, llguidance's `deep_copy` of
  the compiled matcher, the way the engine caches it);
- mask: one step of a constrained batch: every row's matcher fills its row of the token
  bitmask, the bitmask goes to the logits' device and is applied there, then each matcher
  consumes its row's token; the rows walk the tokens of a valid instance of the schema, so the
  time is a mean over a whole output. At batch 1 and 64, on the CPU and on CUDA when present.

Both engines fill the bitmask on the host (llguidance's rows over its thread pool, xgrammar's
through `BatchGrammarMatcher`); the step applies it with the engine's torch apply
(`workers/sampling/token_mask.py`, the same for both); xgrammar's own apply kernel is timed
too (`xgr_apply_us`; llguidance's own needs torch.compile, which the engine does not use).

    python -m bench.grammar_engines [--tokenizer-dir DIR] [--out DIR]

xgrammar is not a dependency of pdserve: `pip install xgrammar` first (without it only
llguidance is measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_common import wall_ms
from bench.results_io import add_out_argument, write_result
from workers.config import DEFAULT_MODEL
from workers.model.files import load_tokenizer, resolve_model
from workers.sampling.token_mask import apply_bitmask

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "status": {"enum": ["pending", "paid", "shipped"]},
        "note": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "status"],
}
INSTANCE = {
    "order_id": 4711,
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
    "items": [
        {"sku": "A-100", "quantity": 2, "price": 9.5},
        {"sku": "B-7", "quantity": 1, "price": 120.0},
    ],
    "status": "paid",
}
BATCHES = (1, 64)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.batch = xgr.BatchGrammarMatcher()
        self.words = self.info.vocab_size

    def compile(self, schema: str, cold: bool) -> Any:
        if cold:
            self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def consume(self, matchers: list[Any], token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()
        self.words = self.tok.vocab_size

    def compile(self, schema: str, cold: bool) -> Any:
        if cold or not hasattr(self, "_cached"):
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
            self._cached = self.llg.LLMatcher(self.tok, grammar)
            return self._cached.deep_copy()
        return self._cached.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def consume(self, matchers: list[Any], token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


def measure(engine: Any, tokens: list[int], device: torch.device, vocab: int) -> list[dict]:
    schema = json.dumps(SCHEMA)
    rows = []
    engine.compile(schema, cold=True)  # first use: lazy set-up of each library
    cold = wall_ms(lambda: engine.compile(schema, cold=True), warmup=0, iters=5)
    cached = wall_ms(lambda: engine.compile(schema, cold=False), warmup=0, iters=20)
    rows.append(dict(engine=engine.name, case="compile", cold_ms=cold, cached_ms=cached))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for batch in BATCHES:
        host = torch.full((batch, -(-engine.words // 32)), -1, dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        logits = torch.randn(batch, vocab, device=device)
        rows_idx = torch.arange(batch, device=device)
        parts: dict[str, list[float]] = {"fill": [], "apply": [], "consume": [], "xgr_apply": []}
        warm = [engine.compile(schema, cold=False)]
        engine.fill(warm, host[:1])
        apply_bitmask(logits, host.to(device), rows_idx)
        matchers = [engine.compile(schema, cold=False) for _ in range(batch)]
        for token in tokens:
            t0 = time.perf_counter()
            engine.fill(matchers, host)
            t1 = time.perf_counter()
            mask = host.to(device, non_blocking=True)
            apply_bitmask(logits, mask, rows_idx)
            sync()
            t2 = time.perf_counter()
            engine.consume(matchers, token)
            t3 = time.perf_counter()
            if hasattr(engine, "apply"):
                engine.apply(logits, mask)
                sync()
            t4 = time.perf_counter()
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[key].append(dt * 1e6)
        mean = {k: statistics.mean(v) for k, v in parts.items()}
        rows.append(
            dict(
                engine=engine.name,
                case=f"step, batch {batch}, {device.type}",
                fill_us=mean["fill"],
                apply_us=mean["apply"],
                consume_us=mean["consume"],
                step_us=mean["fill"] + mean["apply"] + mean["consume"],
                max_fill_us=max(parts["fill"]),
                xgr_apply_us=mean["xgr_apply"] if hasattr(engine, "apply") else None,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="default: SmolLM2's")
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: tokenizer's)")
    add_out_argument(ap)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer_dir or resolve_model(DEFAULT_MODEL))
    vocab = args.vocab or len(tokenizer)
    tokens = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")))
    eos = tokenizer.eos_token_id
    tokens = [*tokens, eos]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    engines: list[Any] = [Llguidance(tokenizer, vocab)]
    if importlib.util.find_spec("xgrammar") is not None:
        engines.append(Xgrammar(tokenizer, vocab))
    for device in devices:
        for engine in engines:
            got = measure(engine, tokens, device, vocab)
            rows += got if device.type == "cpu" else got[1:]  # compile is host work: once
    by = {(r["engine"], r["case"]): r for r in rows}
    for case in dict.fromkeys(r["case"] for r in rows if ("xgrammar", r["case"]) in by):
        llg, xg = by[("llguidance", case)], by[("xgrammar", case)]
        key = "cold_ms" if case == "compile" else "step_us"
        ratio = llg[key] / xg[key]
        llg["x_xgrammar"] = ratio
        print(f"{case:28s} llguidance {llg[key]:9.1f}  xgrammar {xg[key]:9.1f}  "
              f"{key} ratio llg/xgr {ratio:5.2f}", flush=True)  # fmt: skip
        if case == "compile":
            print(f"{'compile, cached':28s} llguidance {llg['cached_ms']:9.3f}  "
                  f"xgrammar {xg['cached_ms']:9.3f}  cached_ms", flush=True)  # fmt: skip
    write_result(
        args.out,
        "grammar-engines",
        rows,
        model=f"SmolLM2 tokenizer ({len(tokenizer)} tokens), logits {vocab} wide; "
        f"a {len(tokens)}-token JSON instance",
        title="Grammar engines: schema compile and per-step mask",
    )


if __name__ == "__main__":
    main()
