"""Offline throughput on nano-vllm's workload, against HF transformers `generate` on the same GPU.

The workload (nano-vllm's bench.py): 256 requests, prompts of 100-1024 random token ids below
10000, 100-1024 output tokens each, temperature 0.6, EOS ignored. Qwen3-0.6B shapes with random
weights in bf16. HF runs a subset (one left-padded batch, sampling to the subset's longest
output); the engine runs the same subset too, so the ratio compares like with like.

    python -m bench.bench_offline_gpu --tokenizer-dir DIR [--hf-subset 32] [--out DIR]
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from bench.gpu_common import bench_parser, dummy_model_dir, engine_options
from bench.results_io import write_result
from workers import LLM, SamplingParams


def workload(num: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num)]
    return prompts, [rng.randint(100, 1024) for _ in range(num)]


def run_engine(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outputs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == sum(outputs), "every request must produce exactly max_tokens"
    return dict(
        requests=len(prompts),
        output_tokens=generated,
        seconds=round(seconds, 2),
        tokens_per_s=round(generated / seconds),
    )


def run_hf(model_dir: Path, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as generate expects
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    new = max(outputs)
    kwargs = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2].cuda(), attention_mask=mask[:2].cuda(), max_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            max_new_tokens=new,
            min_new_tokens=new,
            **kwargs,
        )
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return dict(
        requests=len(prompts),
        output_tokens=sum(outputs),
        computed_tokens=len(prompts) * new,
        seconds=round(seconds, 2),
        tokens_per_s=round(sum(outputs) / seconds),
    )


def main() -> None:
    ap = bench_parser(__doc__, shape="qwen3-0.6b")
    ap.add_argument("--hf-subset", type=int, default=32)
    args = ap.parse_args()
    model_dir = dummy_model_dir(args.shape, args.tokenizer_dir, args.work)
    prompts, outputs = workload()
    llm = LLM(
        str(model_dir),
        **engine_options(
            args,
            load_format="dummy",
            dtype="bfloat16",
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            max_model_len=4096,
            kv_cache_memory_gb=60,
        ),
    )
    llm.generate([prompts[0][:50]], SamplingParams(max_tokens=8))  # warm-up
    full = run_engine(llm, prompts, outputs)
    print("OFFLINE engine", full, flush=True)
    n = args.hf_subset
    subset = run_engine(llm, prompts[:n], outputs[:n])
    print("OFFLINE engine-subset", subset, flush=True)
    del llm
    torch.cuda.empty_cache()
    hf = run_hf(model_dir, prompts[:n], outputs[:n])
    print("OFFLINE hf-subset", hf, flush=True)
    ratio = subset["tokens_per_s"] / hf["tokens_per_s"]
    print(f"OFFLINE engine/hf on the same {n} requests: {ratio:.1f}x", flush=True)
    rows = [
        dict(run="engine, all requests", **full),
        dict(run=f"engine, first {n}", **subset, x_hf=round(ratio, 1)),
        dict(run=f"HF generate, first {n}", **hf),
    ]
    model = f"{args.shape} shapes, random bf16 weights; nano-vllm's workload"
    write_result(args.out, "offline-gpu", rows, model=model)


if __name__ == "__main__":
    main()
