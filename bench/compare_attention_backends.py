"""Where a model's attention backend departs from the torch reference, layer by layer.

Runs one chat prompt through the engine (eager, so every layer's attention is a Python call)
and, inside each layer, also attends the same q, k and v with `TorchAttention` in float32 over
the same pool and batch. Prints each step's relative difference per layer: a healthy bf16 run
stays near 2e-3 at every layer (SmolLM2's real weights on an H200, 2026-11-29). With real
weights, unlike random ones, attention is sharp enough that a wrong kernel input or plan shows.

    python -m bench.compare_attention_backends [--model DIR_OR_GGUF] [--device cuda|cpu]

On CUDA it checks FlashInfer in bfloat16 (the model rotates q and k itself, so the check sees
exactly what the backend attends); on CPU, the torch backend in float32 against itself, which
exercises the tool. The model defaults to `$PDSERVE_SMOLLM2_GGUF` (what `bench/gpu_suite.sh
--model` sets), else the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import os

import torch

from workers import LLM, SamplingParams
from workers.attention.base import AttentionBackend, AttentionBatch
from workers.attention.torch_ref import TorchAttention
from workers.config import DEFAULT_MODEL


def backend_class(device: str) -> type[AttentionBackend]:
    if device == "cpu":
        return TorchAttention
    from workers.attention.flashinfer import FlashInferAttention  # CUDA only

    FlashInferAttention.forward_rotary = None  # type: ignore[assignment,method-assign]
    return FlashInferAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("PDSERVE_SMOLLM2_GGUF", DEFAULT_MODEL))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()

    reference_plan, reference_forward = TorchAttention.plan, TorchAttention.forward
    cls = backend_class(args.device)
    plan, forward = cls.plan, cls.forward
    references: dict[int, TorchAttention] = {}
    steps: list[list[float]] = []  # per step: each layer's relative difference

    def planned(self: AttentionBackend, batch: AttentionBatch) -> None:
        plan(self, batch)
        reference = TorchAttention(self.pool, self.num_q_heads, self.scale)
        reference_plan(reference, batch)
        references[id(self)] = reference
        steps.append([])

    def checked(
        self: AttentionBackend, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = forward(self, layer_id, q, k, v)
        reference = references[id(self)]
        ref = reference_forward(reference, layer_id, q.float(), k.float(), v.float())
        steps[-1].append(float((out.float() - ref).norm() / ref.norm()))
        return out

    cls.plan = planned  # type: ignore[method-assign]
    cls.forward = checked  # type: ignore[method-assign]
    cpu = args.device == "cpu"
    llm = LLM(
        args.model,
        device=args.device,
        dtype="float32" if cpu else "bfloat16",
        attention_backend="torch" if cpu else "flashinfer",
        enforce_eager=True,
        kv_cache_memory_gb=1,
    )
    ids = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    steps.clear()  # forwards of the engine's start
    out = llm.generate([ids], SamplingParams(max_tokens=args.tokens, temperature=0.0))[0]
    print(f"answer: {out.text!r}")
    for i, diffs in enumerate(steps):
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        by_layer = " ".join(f"{d:.0e}" for d in diffs)
        print(f"step {i}: worst layer {worst} at {diffs[worst]:.2e}; by layer {by_layer}")


if __name__ == "__main__":
    main()
