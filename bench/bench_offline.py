"""Offline throughput: pdserve's engine vs HF transformers `generate`, same workload, one run;
also the engine with every request penalised (frequency, presence, repetition, logit bias)
against itself without, which is the cost of those rules on the sampling path.

python -m bench.bench_offline                      # SmolLM2 on CPU, batch 8 x 128 in / 64 out
python -m bench.bench_offline --batch 32 --device cuda --dtype bfloat16 [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.results_io import add_out_argument, write_result
from workers import LLM, SamplingParams


def workload(vocab: int, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (batch, prompt_len), generator=g).tolist()


PENALTIES = dict(
    frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1, logit_bias={"13": -5.0}
)


def bench_ours(llm: LLM, prompts: list[list[int]], out_len: int, **rules: object) -> float:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, **rules)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(o.token_ids) == out_len for o in outs)
    return elapsed


def bench_hf(
    model_dir: str, prompts: list[list[int]], out_len: int, device: str, dtype: torch.dtype
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + out_len
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    add_out_argument(ap)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=False)
    prompts = workload(llm.engine.runner.model_config.vocab_size, args.batch, args.prompt_len)
    ours = bench_ours(llm, prompts, args.output_len)
    penalised = bench_ours(llm, prompts, args.output_len, **PENALTIES)
    dir_ = str(llm.engine.runner.model_dir)
    del llm
    hf = bench_hf(dir_, prompts, args.output_len, args.device, getattr(torch, args.dtype))
    tokens = args.batch * args.output_len
    print(
        f"workload: {args.batch} x {args.prompt_len} in / {args.output_len} out, "
        f"{args.model}, {args.device} {args.dtype}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'engine':<14}{'seconds':>10}{'out tok/s':>12}")
    print(f"{'pdserve':<14}{ours:>10.2f}{tokens / ours:>12.1f}")
    print(f"{'HF generate':<14}{hf:>10.2f}{tokens / hf:>12.1f}")
    print(f"{'penalised':<14}{penalised:>10.2f}{tokens / penalised:>12.1f}")
    print(
        f"ratio pdserve / HF: {hf / ours:.2f}x; penalised / plain pdserve: {ours / penalised:.2f}x"
    )
    row = dict(
        dtype=args.dtype,
        pdserve_out_tok_per_s=round(tokens / ours, 1),
        hf_out_tok_per_s=round(tokens / hf, 1),
        x_hf=round(hf / ours, 2),
        penalised_s=round(penalised, 2),
        plain_s=round(ours, 2),
        x_plain_penalised=round(ours / penalised, 2),
    )
    model = f"{args.model}: {args.batch} x {args.prompt_len} tokens in, {args.output_len} out"
    write_result(args.out, f"offline-{args.device}-{args.dtype}", [row], model=model)


if __name__ == "__main__":
    main()
