"""Ways to store K/V in 8 bits, measured on SmolLM2's real weights on the CPU before building
any of them (docs/notes/fp8-kv.md has the table).

Each variant is simulated on the torch backend: the engine's pool keeps the model's dtype, and
the K/V written into it are first rounded as the variant would store them and read back
("fake quantization"), so one process compares them all. Metrics: the top-5 log-prob error
against HF float32 at the 48 teacher-forced contexts of tests/gpu/test_smollm2_gpu.py (max and
mean, nats), and whether 6 chat answers (greedy, up to --answer-tokens) equal the first
variant's. Static statistics (per-head means and ranges) come from one fixed calibration text.

    python -m bench.kv_quant_variants --dtype bfloat16 --variants none,e4m3,e4m3_dyn,int8_rot
    python -m bench.kv_quant_variants --dtype bfloat16 --kv-cache-dtype int8 --variants none

Variant names join parts: `e4m3` or `int8` (the byte code); `dyn` (a scale per token and head,
amax / max code), `head` (a static scale per layer and head, calibrated amax / 448), neither (E4M3
at scale 1.0); `kmean` (K minus its per-channel mean: softmax ignores it), `kvmean` (V's mean
too, added back after P.V); `rot` (rows rotated by a Hadamard matrix before rounding). `bf16`
rounds to bf16; `none` stores as the pool does.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.gpu.test_smollm2_gpu import CHAT, TEXTS
from tests.unit.test_fp8_kv import TEACHER
from tests.unit.test_int8_kv import CHATS
from workers import LLM, SamplingParams
from workers.attention.torch_ref import TorchAttention
from workers.kvcache.int8_rows import hadamard
from workers.llm import DEFAULT_MODEL
from workers.model.files import resolve_model

CALIBRATION = (
    "The history of mathematics spans thousands of years. Early civilizations counted with "
    "tally marks, and later developed written numerals. def add(a, b):\n    return a + b\n"
    "Q: What is the largest planet? A: Jupiter is the largest planet in our solar system."
)


class Variants:
    """The variant in force and the calibration's statistics, per layer `[Hkv, D]` / `[Hkv]`."""

    def __init__(self) -> None:
        self.name = "none"
        self.recorded: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.stats: dict[str, dict[int, torch.Tensor]] = {}

    def calibrate(self) -> None:
        assert self.recorded is not None
        for name in ("mk", "mv", "ak", "av", "akc", "avc"):
            self.stats[name] = {}
        for layer, parts in self.recorded.items():
            k = torch.cat([p[0] for p in parts])
            v = torch.cat([p[1] for p in parts])
            self.stats["mk"][layer], self.stats["mv"][layer] = k.mean(0), v.mean(0)
            self.stats["ak"][layer], self.stats["av"][layer] = (
                k.abs().amax((0, 2)),
                v.abs().amax((0, 2)),
            )
            self.stats["akc"][layer] = (k - k.mean(0)).abs().amax((0, 2))
            self.stats["avc"][layer] = (v - v.mean(0)).abs().amax((0, 2))
        self.recorded = None

    def store(
        self, layer: int, x: torch.Tensor, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x` (K or V `[T, Hkv, D]`) as the variant stores and reads it; for V with its mean
        taken off, the mean to add to the attention's output."""
        parts = set(self.name.split("_"))
        if self.name == "none":
            return x, None
        if self.name == "bf16":
            return x.to(torch.bfloat16).to(x.dtype), None
        mean = None
        if "kvmean" in parts or ("kmean" in parts and kind == "k"):
            mean = self.stats[f"m{kind}"][layer]
        y = x.float() - (mean if mean is not None else 0.0)
        h = hadamard(y.shape[-1], y.device) if "rot" in parts else None
        if h is not None:
            y = y @ h
        code_max = 127.0 if "int8" in parts else 448.0
        if "dyn" in parts:
            scale = (y.abs().amax(-1, keepdim=True) / code_max).clamp_min(1e-30)
        elif "head" in parts:
            centred = "c" if mean is not None else ""
            scale = self.stats[f"a{kind}{centred}"][layer][:, None] / code_max
        else:
            scale = torch.tensor(1.0)
        if "int8" in parts:
            y = (y / scale).round().clamp(-127, 127) * scale
        else:
            y = (y / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        if h is not None:
            y = y @ h
        keep_mean = kind == "v" and mean is not None
        return y.to(x.dtype), mean if keep_mean else None


VARIANTS = Variants()
_forward = TorchAttention.forward


def _forward_variant(self: TorchAttention, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:  # fmt: skip
    if VARIANTS.recorded is not None:
        VARIANTS.recorded.setdefault(layer_id, []).append((k.float().clone(), v.float().clone()))
        return _forward(self, layer_id, q, k, v)
    k, _ = VARIANTS.store(layer_id, k, "k")  # K's mean needs no correction: softmax drops it
    v, v_mean = VARIANTS.store(layer_id, v, "v")
    out = _forward(self, layer_id, q, k, v)
    if v_mean is not None:  # rows of P sum to 1: P.(V - m) + m = P.V
        out = out + v_mean.repeat_interleave(q.shape[1] // k.shape[1], 0).to(out.dtype)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "int8"])
    parser.add_argument("--variants", default="none,e4m3,int8_dyn")
    parser.add_argument("--answer-tokens", type=int, default=40)
    args = parser.parse_args()
    TorchAttention.forward = _forward_variant  # type: ignore[method-assign]
    model_dir = resolve_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def chat(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    texts, reference = [], []
    firsts = [chat(CHAT[0]["content"]), *(tok(t)["input_ids"] for t in TEXTS)]
    for prompt, greedy in zip(firsts, TEACHER):
        texts.append((len(prompt), prompt + greedy))
        with torch.inference_mode():
            fp32 = hf(torch.tensor([texts[-1][1]])).logits[0].double().log_softmax(-1)
        reference += list(fp32[len(prompt) - 1 : -1])
    llm = LLM(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    VARIANTS.recorded = {}
    llm.generate([tok(CALIBRATION)["input_ids"]], SamplingParams(max_tokens=1))
    VARIANTS.calibrate()
    answers = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0)
    first_answers = None
    for name in args.variants.split(","):
        VARIANTS.name = name
        outs = llm.generate([t for _, t in texts], SamplingParams(max_tokens=1, prompt_logprobs=5))
        tops = [e.top for (start, _), o in zip(texts, outs) for e in o.prompt_logprobs[start:]]  # type: ignore[index]
        errors = [max(abs(lp - float(ref[t])) for t, lp in top.items())
                  for top, ref in zip(tops, reference, strict=True)]  # fmt: skip
        said = [o.text for o in llm.generate([chat(c) for c in CHATS], answers)]
        first_answers = first_answers or said
        row = {"variant": name, "max": round(max(errors), 3),
               "mean": round(sum(errors) / len(errors), 3),
               "answers_as_first": sum(a == b for a, b in zip(said, first_answers)),
               "answers": said}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
