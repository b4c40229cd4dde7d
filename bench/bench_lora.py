"""Multi-LoRA decode: a decode step of `batch` requests spread over `adapters` LoRA adapters of
rank `rank` (every projection targeted) against the same batch without adapters.

    python bench/bench_lora.py --device cuda --out DIR [--tokenizer-dir DIR] [--batches 16 64]
    python bench/bench_lora.py --device cuda --out DIR --products after,beside,epilogue
    python bench/bench_lora.py --device cuda --products beside --profile   # by kernel kind
    python bench/bench_lora.py --device cpu       # a smoke run: tiny shapes, a few steps

On CUDA the model has Llama-3-8B's shapes with random bf16 weights (load_format dummy) and the
adapters random PEFT files. The batch is prefilled to `--context` tokens, then `Engine.step()`
runs the timed decode steps (wall time per step, the median of `--repeats` runs). The base batch
replays its CUDA graph; a step holding adapters replays its size's LoRA graph, with the SGMV
LoRA products on the folded layer path (docs/architecture.md, "LoRA adapters"). The floor of
each step is the bytes it must read (the weights, the batch's KV, and with adapters the A/B of
the adapters it holds) over the copy rate measured in the same process; `x_base` is the LoRA
step's time over the base step's. `--products` picks where the products run
(`KernelConfig.lora_products`): after their base GEMMs, beside them on a second stream, or the
expand in the GEMMs' epilogue; several, comma-separated, run one engine after another in one
process, each row with its own base step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
TITLE = "Multi-LoRA decode: 8 adapters of rank 16 against the same batch without adapters"
sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.gpu_common import (  # noqa: E402
    Floor,
    add_set_argument,
    dummy_model_dir,
    embedded_model_dir,
    engine_options,
    median_of,
    step_timeline,
)
from bench.results_io import add_out_argument, write_result  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.lora.adapter import TARGET_MODULES, module_shape  # noqa: E402
from workers.model.config import ModelConfig  # noqa: E402
from workers.model.files import load_model_config  # noqa: E402
from workers.protocol import GenerateRequest, LoRARequest, SamplingParams  # noqa: E402


def write_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in TARGET_MODULES:
            n_in, n_out = module_shape(cfg, module)
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{{}}.weight"
            tensors[key.format("A")] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[key.format("B")] = torch.randn(n_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))  # fmt: skip
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGET_MODULES)}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(conf))
    return out


def decode_ms(
    engine: Engine, loras: list[LoRARequest | None], context: int, steps: int,
    profile: str | None = None,
) -> float:  # fmt: skip
    """Wall ms per decode step of `len(loras)` requests prefilled to `context` tokens; with
    `profile` (a label), then one more step's device time by kernel kind, printed."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, lora in enumerate(loras):
        ids = tuple((i * 7919 + t) % 30000 + 100 for t in range(context))  # no shared prefix
        req = GenerateRequest(request_id=f"r{time.monotonic_ns()}-{i}", prompt_token_ids=ids,
                              params=params, lora=lora)  # fmt: skip
        seqs.append(engine.add_request(req))
    while any(s.num_output_tokens < 2 for s in seqs):  # prefilled, decoding
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    taken = (time.perf_counter() - start) * 1e3 / steps
    if profile:
        print(f"PROFILE {profile}\n{step_timeline(engine.step)}", flush=True)
    while engine.has_work():
        for seq in seqs:
            engine.abort(seq.request_id)
        engine.step()
    return taken


def measure(
    args: argparse.Namespace, cfg: EngineConfig, loras: list[LoRARequest], floor: Floor | None
) -> list[dict]:
    """Each batch size's base and LoRA step with `cfg`'s engine, freed before returning."""
    engine = Engine(cfg)
    weight_bytes = engine.runner.weight_bytes
    assert engine.runner.lora is not None
    adapter_bytes = engine.runner.lora.adapter(loras[0]).nbytes // 2  # host float32, device bf16
    kv_token_bytes = engine.runner.kv_layout.page_bytes // cfg.page_size
    rows = []
    for batch in args.batches:
        mixed = [loras[i % args.adapters] for i in range(batch)]
        base = median_of([decode_ms(engine, [None] * batch, args.context, args.steps)
                          for _ in range(args.repeats)])  # fmt: skip
        lora = median_of([decode_ms(engine, list(mixed), args.context, args.steps)
                          for _ in range(args.repeats)])  # fmt: skip
        if args.profile and torch.cuda.is_available():
            name = f"batch {batch}, products {cfg.kernels.lora_products}"
            decode_ms(engine, [None] * batch, args.context, 2, profile=f"{name}: base step")
            decode_ms(engine, list(mixed), args.context, 2, profile=f"{name}: LoRA step")
        kv = batch * (args.context + args.steps // 2) * kv_token_bytes
        held = min(batch, args.adapters)
        row = {"batch": batch, "adapters": held, "rank": args.rank, "context": args.context,
               "products": cfg.kernels.lora_products, "base_ms": base, "lora_ms": lora,
               "x_base": round(lora / base, 3)}  # fmt: skip
        if floor is not None:
            row |= {f"base_{k}": v for k, v in floor.columns(weight_bytes + kv, base).items()}
            lora_bytes = weight_bytes + kv + held * adapter_bytes
            row |= {f"lora_{k}": v for k, v in floor.columns(lora_bytes, lora).items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del engine
    gc.collect()  # the runner's graphs and pools, before the next engine allocates its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    tokenizer = embedded_model_dir()  # tokenizer files for the dummy model
    ap.add_argument("--tokenizer-dir", type=Path, required=tokenizer is None, default=tokenizer)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--products", default="after",
                    help="where the LoRA products run (KernelConfig.lora_products), one engine "
                    "after another: e.g. after,beside,epilogue")  # fmt: skip
    ap.add_argument("--profile", action="store_true",
                    help="each batch's base and LoRA step by kernel kind (CUDA)")  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-bench")
    add_set_argument(ap)
    add_out_argument(ap)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if not cuda:  # smoke: tiny shapes, small batches, a few steps
        args.batches, args.context, args.steps, args.repeats = [4], 32, 3, 1
    shape = "llama3-8b" if cuda else "tiny-llama"
    model_dir = dummy_model_dir(shape, args.tokenizer_dir, args.work)
    model_config = load_model_config(model_dir)
    adapter_dirs = [write_adapter(args.work / f"lora-{shape}-{i}", model_config, args.rank, i)
                    for i in range(args.adapters)]  # fmt: skip
    loras = [LoRARequest(lora_name=f"a{i}", lora_int_id=i + 1, lora_path=str(d))
             for i, d in enumerate(adapter_dirs)]  # fmt: skip
    floor = None
    if cuda:
        floor = Floor.measure()
    rows = []
    for products in args.products.split(","):  # one engine at a time: each holds the model
        fields = dict(
            model=str(model_dir), load_format="dummy", device=args.device,
            dtype="bfloat16" if cuda else "float32", enable_lora=True, max_loras=args.adapters,
            max_lora_rank=args.rank, max_num_seqs=max(args.batches),
            enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.context),
            num_kv_pages=max(args.batches) * -(-(args.context + args.steps + 32) // 16) + 1,
            cuda_graph_batch_sizes=tuple(args.batches), kernels={"lora_products": products},
        )  # fmt: skip
        rows += measure(args, EngineConfig(**engine_options(args, **fields)), loras, floor)
    model = f"{shape} shapes, random {'bf16' if cuda else 'float32'} weights"
    write_result(args.out, "lora-decode", rows, model=model, title=TITLE,
                 measured=None if floor is None else floor.measured())  # fmt: skip


if __name__ == "__main__":
    main()
