"""Multi-turn conversations over a KV pool they outgrow: the host tier against none, one run.

python -m bench.bench_kv_tiers [--out DIR]                       # CPU: SmolLM2, small sizes
python -m bench.bench_kv_tiers --shape llama3-8b --tokenizer-dir DIR [--out DIR]   # a GPU

N conversations, each a document and then a question per turn; a turn's prompt is the whole
conversation so far (document, earlier questions and answers, its question). Turns arrive at a
fixed rate, round-robin over the conversations (a turn waits for its conversation's previous
answer), so between two turns of one conversation every other one passes through the pool:
their KV together is at least 4x the pool, so without a tier below it a later turn finds
little of its conversation. Reported per mode: TTFT p50 of the later turns (2..), the turns'
throughput, the host tier's hits, and its loads' bandwidth against the host-to-device copy rate
measured in the same process (on the CPU: a memcpy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch

from bench.gpu_common import SHAPES, dummy_model_dir, engine_options
from bench.results_io import add_out_argument, write_result
from workers.config import DEFAULT_MODEL, EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.model.files import load_model_config, resolve_model
from workers.protocol import EngineStats, GenerateRequest, SamplingParams

# (conversations, turns, document, question, answer tokens, pool pages, turns a second)
CPU_SIZES = dict(conversations=8, turns=3, doc_len=256, question_len=32, answer_len=16,
                 pool_pages=48, rate=0.5)  # fmt: skip
GPU_SIZES = dict(conversations=48, turns=4, doc_len=2048, question_len=128, answer_len=128,
                 pool_pages=1536, rate=16.0)  # fmt: skip
PAGE_SIZE = 16


def conversations(n: int, doc_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 1, (doc_len,), generator=g).tolist() for _ in range(n)]


def questions(n: int, turns: int, length: int, vocab: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(turns)]
        for _ in range(n)
    ]


async def serve(engine: AsyncEngine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Run every conversation; per turn index, the TTFTs; and the run's seconds."""
    docs = conversations(args.conversations, args.doc_len, vocab)
    asks = questions(args.conversations, args.turns, args.question_len, vocab)
    params = SamplingParams(max_tokens=args.answer_len, temperature=0.0, ignore_eos=True)
    ttft: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    answers: list[list[list[int]]] = [[] for _ in docs]
    start = time.perf_counter()

    async def conversation(c: int) -> None:
        history = list(docs[c])
        for turn in range(args.turns):
            due = start + (turn * args.conversations + c) / args.rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            prompt = history + asks[c][turn]
            req = GenerateRequest(request_id=f"c{c}t{turn}", prompt_token_ids=prompt,
                                  params=params)  # fmt: skip
            sent, first, out = time.perf_counter(), None, list[int]()
            async for chunk in engine.generate(req):
                first = first or time.perf_counter()
                out += chunk.token_ids
            assert first is not None
            ttft[turn].append(first - sent)
            answers[c].append(out)
            history = prompt + out

    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return {"seconds": time.perf_counter() - start, "ttft": ttft, "answers": answers}


def run_mode(cfg: EngineConfig, args: argparse.Namespace) -> tuple[dict[str, Any], EngineStats]:
    engine = AsyncEngine(Engine(cfg))
    try:
        vocab = engine.engine.runner.model_config.vocab_size
        warm = GenerateRequest(request_id="warm", prompt_token_ids=[1, 2, 3],
                               params=SamplingParams(max_tokens=2))  # fmt: skip

        async def warm_up() -> None:
            async for _ in engine.generate(warm):
                pass

        asyncio.run(warm_up())
        result = asyncio.run(serve(engine, args, vocab))
        return result, engine.engine.stats()
    finally:
        engine.shutdown()


def copy_rate_gbps(page_bytes: int, pages: int, device: torch.device) -> float:
    """Host-to-device copy of `pages` pages in one piece (pinned host memory on a GPU; on the
    CPU a memcpy), GB/s, the median of 5."""
    n = page_bytes * pages
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").random_()
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights of these shapes")
    ap.add_argument("--tokenizer-dir", help="with --shape: the tokenizer files")
    ap.add_argument("--work", default="/tmp/pdserve-bench", help="with --shape: the model dir")
    for key in CPU_SIZES:
        ap.add_argument("--" + key.replace("_", "-"), type=type(CPU_SIZES[key]))
    ap.add_argument("--host-gb", type=float, help="the host tier (default: every conversation)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode, alternating")
    ap.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="PATH=VALUE",
        help="an EngineConfig field, as `pdserve serve --set`",
    )  # fmt: skip
    add_out_argument(ap)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    for key, value in (GPU_SIZES if cuda else CPU_SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.shape is not None and args.tokenizer_dir is None:
        ap.error("--shape needs --tokenizer-dir (the tokenizer files of a model of that family)")
    if args.shape is not None:
        from pathlib import Path

        model = str(dummy_model_dir(args.shape, Path(args.tokenizer_dir), Path(args.work)))
        fields: dict[str, Any] = dict(model=model, load_format="dummy", dtype="bfloat16")
    else:
        fields = dict(model=DEFAULT_MODEL)
    fields.update(page_size=PAGE_SIZE, num_kv_pages=args.pool_pages + 1)
    base = engine_options(args, **fields)
    tokens = args.doc_len + args.turns * (args.question_len + args.answer_len)
    cfg = EngineConfig(**base)
    device, mc = cfg.resolved_device(), load_model_config(resolve_model(cfg.model, cfg.load_format))
    itemsize = cfg.resolved_dtype(device).itemsize if cfg.kv_cache_dtype == "auto" else 1
    page_bytes = mc.num_layers * 2 * PAGE_SIZE * mc.num_kv_heads * mc.head_dim * itemsize
    total_pages = args.conversations * -(-tokens // PAGE_SIZE)
    host_gb = args.host_gb or 1.25 * total_pages * page_bytes / 2**30
    modes = {
        "none": EngineConfig(**base),
        "host": EngineConfig(**base, kv_offload={"cpu_gb": host_gb}),
    }
    runs: dict[str, list[tuple[dict[str, Any], EngineStats]]] = {name: [] for name in modes}
    for _ in range(args.repeats):  # alternating, so a shared host's load falls on both alike
        for name, cfg in modes.items():
            runs[name].append(run_mode(cfg, args))
    same = [a == b for a, b in zip(*(r[0][0]["answers"] for r in runs.values()), strict=True)]
    copy = copy_rate_gbps(page_bytes, min(total_pages, 256), device)

    def later_ttft(name: str) -> float:  # turns 2.. of every run
        return statistics.median(
            t for res, _ in runs[name] for t in sum(list(res["ttft"].values())[1:], [])
        )

    def seconds(name: str) -> float:
        return sum(res["seconds"] for res, _ in runs[name])

    rows = []
    for name, mode_runs in runs.items():
        stats = [st for _, st in mode_runs]
        loaded, load_s = (
            sum(st.kv_onload_bytes for st in stats),
            sum(st.kv_onload_time_s for st in stats),
        )
        load = loaded / load_s / 1e9 if load_s else None
        first = statistics.median(t for res, _ in mode_runs for t in res["ttft"][0])
        rows.append(dict(
            tier=name,
            later_ttft_p50_ms=round(later_ttft(name) * 1e3, 1),
            first_ttft_p50_ms=round(first * 1e3, 1),
            x_none_ttft=round(later_ttft(name) / later_ttft("none"), 2),
            turns_per_s=round(args.repeats * args.conversations * args.turns / seconds(name), 2),
            x_none_throughput=round(seconds("none") / seconds(name), 2),
            prompt_tokens_computed=stats[0].prompt_tokens_computed,
            host_hit_tokens=stats[0].kv_host_hit_tokens,
            load_gbps=None if load is None else round(load, 2),
            x_copy_load=None if load is None else round(load / copy, 2),
        ))  # fmt: skip
    for row in rows:
        print(row)
    hw = "GPU" if cuda else "CPU"
    name = args.shape or "SmolLM2-135M-Instruct"
    model = (
        f"{name} on {hw}: {args.conversations} conversations x {args.turns} turns (a "
        f"{args.doc_len}-token document, {args.question_len}-token questions, "
        f"{args.answer_len}-token answers), {args.rate} turns/s round-robin; a pool of "
        f"{args.pool_pages} pages of {PAGE_SIZE} tokens against {total_pages} pages of KV "
        f"({total_pages / args.pool_pages:.1f}x); host tier {host_gb:.2f} GiB; "
        f"{args.repeats} run(s) of each, alternating"
    )
    measured = {
        "host_to_device_copy_gbps": round(copy, 2),
        "page_mib": round(page_bytes / 2**20, 3),
    }
    notes = f"Greedy answers identical in both modes for {sum(same)} of {len(same)} conversations."
    title = f"KV tiers: multi-turn conversations with and without host memory ({hw})"
    write_result(
        args.out, "kv-tiers", rows, model=model, measured=measured, title=title, notes=notes
    )


if __name__ == "__main__":
    main()
