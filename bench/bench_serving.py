"""Online serving over HTTP: disaggregated prefill/decode against the colocated engine.

Starts the Serve application (`cluster.app:build_app`) in each mode in turn on the same
resources: disaggregated, P prefill and D decode replicas with KV handed over by NIXL;
colocated, P + D replicas that each prefill and decode whole requests. Each gets the same
workload through its OpenAI endpoint, as `vllm bench serve` sends it: streamed completions of
random token-id prompts (`ignore_eos`, `stream_options.include_usage`), Poisson arrivals at
each of `--request-rate` (a list: the application stays up between rates), optionally at most
`--max-concurrency` in flight. With `--turns T` each arrival is a conversation of T requests
sent one after another, each prompt extending the one before (prefix caches, prefix routing).
Per mode and rate it reports request and output-token throughput and the mean, median and P99
of TTFT (to the first chunk), TPOT ((end - TTFT) / (output tokens - 1)), ITL (gaps between
chunks) and end-to-end latency; with `--goodput ttft:MS tpot:MS` also the goodput (requests a
second that met every SLO); then each figure's ratio, disaggregated over colocated.
`--base-url` adds a server started elsewhere (vLLM, SGLang, ... serving the same model) as one
more column, on the same prompts; `--modes ""` measures that server alone.

    python bench/bench_serving.py                                   # CPU, the embedded SmolLM2
    python bench/bench_serving.py --device cuda --tokenizer-dir D --shape llama3-8b \\
        --input-len 2048 --output-len 256 --num-prompts 200 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from bench.results_io import add_out_argument, write_result  # noqa: E402
from bench.serving_load import (  # noqa: E402
    make_conversations,
    parse_slo,
    run_workload,
    steady_rate,
    summarize,
    tpot,
)
from cluster.app import build_app  # noqa: E402
from workers.config import DEFAULT_MODEL  # noqa: E402
from workers.model.files import load_model_config, resolve_model  # noqa: E402
from workers.parallel.rendezvous import free_port  # noqa: E402

MODES = ("disaggregated", "colocated")
APP = "pdserve-bench"


def app_config(args: argparse.Namespace, mode: str, model: str) -> dict[str, Any]:
    """The same resources in both modes: P + D replicas of one rank each."""
    engine: dict[str, Any] = {
        "model": model, "device": args.device, "page_size": 16, "load_format": args.load_format,
    }  # fmt: skip
    if args.stream_interval_ms is not None:
        engine["stream_interval_ms"] = args.stream_interval_ms
    if args.device == "cpu":
        engine |= {"kv_cache_memory_gb": 1.0, "max_num_batched_tokens": 1024}
    else:
        engine["dtype"] = "bfloat16"
    pool = {"num_cpus_per_rank": args.cpus_per_replica, "num_gpus_per_rank": args.gpus_per_replica}
    router = {
        "num_cpus": 0,
        "num_replicas": args.router_replicas,
        "decode_prefill_max_tokens": args.decode_prefill_max_tokens,
        "decode_prefix_aware": args.decode_prefix_aware,
    }
    config: dict[str, Any] = {"engine": engine, "mode": mode, "router": router}
    if mode == "disaggregated":
        config["prefill"] = {**pool, "num_replicas": args.prefill_replicas}
        config["decode"] = {**pool, "num_replicas": args.decode_replicas}
    else:
        config["decode"] = {**pool, "num_replicas": args.prefill_replicas + args.decode_replicas}
    return config


def print_table(rows: dict[str, dict[str, float]]) -> None:
    modes = list(rows)
    ratio = len(modes) == 2
    head = f"{'':<20}" + "".join(f"{m:>15}" for m in modes)
    print(head + (f"{modes[0][:5] + '/' + modes[1][:5]:>13}" if ratio else ""))
    for key in rows[modes[0]]:
        line = f"{key:<20}" + "".join(f"{rows[m][key]:>15.2f}" for m in modes)
        if ratio and rows[modes[1]][key]:
            line += f"{rows[modes[0]][key] / rows[modes[1]][key]:>13.2f}"
        print(line)


def model_for(args: argparse.Namespace) -> str:
    """The model the engines load: --model, or with --shape a random-weight directory."""
    if args.shape is None:
        return args.model
    from bench.gpu_common import dummy_model_dir

    if args.tokenizer_dir is None:
        raise SystemExit("--shape needs --tokenizer-dir")
    args.load_format = "dummy"
    return str(dummy_model_dir(args.shape, args.tokenizer_dir, Path("/tmp/pdserve-bench")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--shape", help="random weights of this shape (bench/gpu_common.SHAPES)")
    ap.add_argument("--tokenizer-dir", type=Path, help="with --shape: its tokenizer files")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prefill-replicas", type=int, default=1)
    ap.add_argument("--decode-replicas", type=int, default=1)
    ap.add_argument("--cpus-per-replica", type=float, default=1)
    ap.add_argument("--gpus-per-replica", type=float, default=None, help="default: 1 on cuda")
    ap.add_argument("--router-replicas", type=int, default=1)
    ap.add_argument("--decode-prefill-max-tokens", type=int, default=0, help="router's knob")
    ap.add_argument("--decode-prefix-aware", action="store_true", help="router's knob")
    ap.add_argument("--stream-interval-ms", type=float, help="engine's knob (default: its own)")
    ap.add_argument("--num-prompts", type=int, default=32, help="conversations (--turns each)")
    ap.add_argument("--turns", type=int, default=1, help="prompts a conversation, in sequence")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens a prompt")
    ap.add_argument("--num-prefixes", type=int, default=1)
    ap.add_argument("--request-rate", default="inf", help="conversations a second; a list: each")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                    help="SLOs for the goodput, e.g. ttft:500 tpot:50")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", help="also measure the server there, e.g. http://host:8000")
    add_out_argument(ap)
    args = ap.parse_args()
    if args.gpus_per_replica is None:
        args.gpus_per_replica = 1.0 if args.device == "cuda" else 0.0
    model = model_for(args)
    rates = [float(r) for r in args.request_rate.split(",")]
    slo = parse_slo(args.goodput)
    # other prompts at each rate: a rate must not find the previous rate's in the prefix cache
    workloads = [
        make_conversations(args, args.seed + 1 + i, args.num_prompts) for i in range(len(rates))
    ]
    limit = load_model_config(resolve_model(model, args.load_format)).context_limit()
    if any(len(p) + n > limit for w in workloads for c in w for p, n in c):
        raise SystemExit(f"a prompt plus its output exceeds the model's {limit} tokens")
    warmup = make_conversations(args, args.seed, 2)
    rows: dict[float, dict[str, dict[str, float]]] = {rate: {} for rate in rates}
    per_request: dict[str, list[dict[str, float]]] = {}  # for the JSON: other SLOs, plots

    def measure(label: str, url: str, served: str) -> None:
        """Every rate's workload against the server at `url`, into `rows[rate][label]`."""
        asyncio.run(run_workload(url, served, warmup, math.inf, None, args.seed))
        for i, rate in enumerate(rates):
            results, duration = asyncio.run(
                run_workload(url, served, workloads[i], rate, args.max_concurrency, args.seed)
            )
            for r in results:
                if not r.ok:
                    print(f"{label}: a request failed: {r.error}", flush=True)
            rows[rate][label] = row = summarize(results, duration, slo) | steady_rate(results)
            first_send = min((r.sent_at for r in results), default=0.0)
            per_request[f"{label}@{rate}"] = [
                dict(
                    ok=r.ok,
                    prompt_tokens=r.prompt_tokens,
                    output_tokens=r.output_tokens,
                    ttft_s=r.ttft,
                    tpot_s=tpot(r),
                    e2e_s=r.e2e,
                    sent_s=r.sent_at - first_send,
                )
                for r in results
            ]
            print(f"BENCH_SERVING {json.dumps(dict(mode=label, rate=rate, **row))}", flush=True)

    modes = [m for m in args.modes.split(",") if m]
    if modes:
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for mode in modes:
                t0 = time.perf_counter()
                serve.run(build_app(app_config(args, mode, model)), name=APP, route_prefix="/")
                print(f"{mode}: up in {time.perf_counter() - t0:.0f} s", flush=True)
                measure(mode, f"http://127.0.0.1:{port}/v1/completions", model)
                serve.delete(APP)
        finally:
            serve.shutdown()
            ray.shutdown()
    if args.base_url:  # another server (vLLM, SGLang, ...) already serving the same model
        base = args.base_url.rstrip("/")
        served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        measure(urlparse(base).netloc, f"{base}/v1/completions", served)
    shape = args.shape or Path(model).name
    workload_text = (
        f"{shape} on {args.device}: {args.num_prompts} conversations of {args.turns} turns "
        f"of {args.input_len} new tokens "
        f"(+{args.prefix_len} shared, ±{args.range_ratio:.0%}), {args.output_len} out, "
        f"concurrency {args.max_concurrency or 'unlimited'}; disaggregated: "
        f"{args.prefill_replicas}P+{args.decode_replicas}D, colocated: "
        f"{args.prefill_replicas + args.decode_replicas} replicas"
    )
    print(f"\n{workload_text}")
    for rate, by_mode in rows.items():
        print(f"\nrate {rate}/s")
        print_table(by_mode)
    table = [
        dict(rate_per_s=rate, mode=mode, **{k: round(v, 3) for k, v in figures.items()})
        for rate, by_mode in rows.items()
        for mode, figures in by_mode.items()
    ]
    write_result(args.out, "serving", table, model=workload_text, requests=per_request)


if __name__ == "__main__":
    main()
