"""SmolLM2-135M-Instruct's real weights: the engine on a GPU against HF transformers on it.

float32 with the torch backend gives HF's greedy tokens exactly. bfloat16 cannot, and with real
weights the chat question shows why: HF float32 puts "The" only 0.25 nats above "L" ('L'Étoile…)
as the answer's first token, and bf16's rounding, through 30 layers, moves such gaps by as much.
So in bf16 (FlashInfer, CUDA graphs, overlap scheduling) the engine is held to HF's own bf16:
its next-token log-probs must be about as close to HF float32's as HF bf16's are, and each token
it generates must be within bf16's reach of HF float32's best. With an FP8 KV cache the same
contexts are measured next to bf16's, and greedy text is compared with the bf16-KV engine's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy
from tests.gpu.conftest import hf_judge
from tests.gpu.test_engine_gpu import PROMPTS, decode_steps, greedy, new_sequences
from tests.unit.test_engine_matches_hf import PROMPTS as TEXT_PROMPTS
from workers import LLM, SamplingParams
from workers.protocol import RequestOutput

pytestmark = pytest.mark.gpu

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [  # each over one 16-token page, so every context has a cached prefix the second time
    "Question: which city is the capital of France, and what is it famous for? Answer: The "
    "capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, counting from fib(0) = 0."""\n',
    "Once upon a time, in a small village nestled between two mountains, there lived an old "
    "clockmaker who",
]
NEW_TOKENS = 24
TEACHER_TOKENS = 12  # contexts per prompt: the prompt plus HF float32's first 0..11 tokens
TOP = 5
REAL_SLACK = 0.5  # nats: a generated token may fall this far below HF float32's best


@pytest.fixture(scope="module")
def hf_real(smollm2_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.to("cuda").eval()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    """The chat question, then plain text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return [chat, *(tok(text)["input_ids"] for text in TEXTS)]


@pytest.fixture(scope="module")
def bf16_llm(smollm2_dir: Path) -> LLM:
    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
        kv_cache_memory_gb=1,
    )
    assert llm.engine.runner.graphs is not None and llm.engine.overlap
    return llm


def test_float32_engine_gives_hf_greedy_tokens(
    smollm2_dir: Path, hf_real, prompts: list[list[int]]
) -> None:
    prompts = [*prompts, *PROMPTS[:3]]
    expected = [hf_greedy(hf_real, p, NEW_TOKENS) for p in prompts]
    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        kv_cache_memory_gb=1,
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))] == expected


def _hf_log_probs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Next-token log-probs after every prefix of `ids`: [len(ids), vocab], float64 on the CPU."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device="cuda")).logits[0]
    return logits.double().log_softmax(dim=-1).cpu()


def _teacher_forced(
    hf_real,
    prompts: list[list[int]],  # noqa: ANN001 - a transformers model
) -> tuple[list[list[int]], list[torch.Tensor], list[float]]:
    """The 48 contexts (each prompt plus HF float32's first 0..11 greedy tokens), HF float32's
    log-probs after each, and HF bf16's largest top-5 error against those at each."""
    hf_bf16 = copy.deepcopy(hf_real).to(torch.bfloat16)
    contexts: list[list[int]] = []
    reference: list[torch.Tensor] = []  # HF float32's log-probs after each context
    hf_bf16_errors: list[float] = []
    for prompt in prompts:
        text = prompt + hf_greedy(hf_real, prompt, TEACHER_TOKENS)
        fp32, bf16 = _hf_log_probs(hf_real, text), _hf_log_probs(hf_bf16, text)
        for end in range(len(prompt), len(text)):
            contexts.append(text[:end])
            reference.append(fp32[end - 1])
            top = bf16[end - 1].topk(TOP).indices
            hf_bf16_errors.append(float((bf16[end - 1, top] - fp32[end - 1, top]).abs().max()))
    return contexts, reference, hf_bf16_errors


def _top_errors(outs: list[RequestOutput], reference: list[torch.Tensor]) -> list[float]:
    """Per output: the largest error of its top log-probs against the reference log-probs."""
    errors = []
    for out, ref in zip(outs, reference):
        assert out.logprobs is not None
        errors.append(max(abs(lp - float(ref[t])) for t, lp in out.logprobs[0].top.items()))
    return errors


def test_bfloat16_log_probs_are_as_close_to_float32_as_hf_bfloat16s(
    hf_real, prompts: list[list[int]], bf16_llm: LLM
) -> None:
    """Teacher-forced on HF float32's greedy text: at each of 48 contexts, the largest error of
    a top-5 log-prob against HF float32, for the engine (all contexts in one batch, then again
    from the prefix cache) and for HF bf16. A wrong kernel input (a page, a position, a plan)
    errs by nats; bf16 rounding by hundredths."""
    contexts, reference, hf_bf16_errors = _teacher_forced(hf_real, prompts)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    hf_worst = max(hf_bf16_errors)
    for attempt in ("batched", "prefix-cached"):
        outs = bf16_llm.generate(contexts, params)
        if attempt == "prefix-cached":
            assert all(o.num_cached_tokens > 0 for o in outs)
        errors = _top_errors(outs, reference)
        mean, hf_mean = sum(errors) / len(errors), sum(hf_bf16_errors) / len(errors)
        print(f"{attempt}: engine bf16 error max {max(errors):.3f} mean {mean:.3f}; "
              f"HF bf16 max {hf_worst:.3f} mean {hf_mean:.3f}")  # fmt: skip
        assert max(errors) <= 2 * hf_worst + 0.05, (attempt, errors)
        assert mean <= 2 * hf_mean + 0.02, (attempt, errors)


def test_bfloat16_graphs_generate_within_reach_of_hf_best(
    hf_real, prompts: list[list[int]], bf16_llm: LLM
) -> None:
    outs = bf16_llm.generate(prompts, greedy(NEW_TOKENS))
    for prompt, out in zip(prompts, outs):
        _, shortfall = hf_judge(hf_real, prompt, out.token_ids)
        print(f"{out.text!r}: shortfall max {float(shortfall.max()):.3f}")
        assert float(shortfall.max()) < REAL_SLACK, f"token far from HF's best: {shortfall}"


# -- FP8 KV cache -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_llm(smollm2_dir: Path) -> LLM:
    llm = LLM(
        str(smollm2_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
        kv_cache_memory_gb=1, kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    assert llm.engine.runner.graphs is not None and llm.engine.runner.pool.is_fp8
    return llm


@pytest.fixture(scope="module")
def int8_llm(smollm2_dir: Path) -> LLM:
    """int8 KV (a scale per token and head inside the rows) on the flashinfer backend: decode
    graphs read it with the Triton kernel, prefill FlashInfer over dequantized pages."""
    llm = LLM(
        str(smollm2_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
        kv_cache_memory_gb=1, kv_cache_dtype="int8",
    )  # fmt: skip
    graphs = llm.engine.runner.graphs
    assert llm.engine.runner.pool.pages.dtype == torch.int8 and graphs is not None
    assert all(a.int8 is not None for a in graphs.attn.values())
    return llm


@pytest.fixture(scope="module")
def int8_torch_llm(smollm2_dir: Path) -> LLM:
    """int8 KV on the torch backend (no graphs): the same rows read by the reference."""
    return LLM(
        str(smollm2_dir), device="cuda", dtype="bfloat16", attention_backend="torch",
        kv_cache_memory_gb=1, kv_cache_dtype="int8",
    )  # fmt: skip


GOAL = 1.5  # the 8-bit cache's error within 1.5x of the bf16 KV cache's, mean and max


def _context_errors(
    contexts: list[list[int]], reference: list[torch.Tensor], runs: list[tuple[str, LLM]]
) -> dict[str, tuple[float, float]]:
    """Per run (a name ending in "cached": the contexts again, from the prefix cache) the max
    and mean top-5 error against HF float32 at the teacher-forced contexts."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    summary = {}
    for name, llm in runs:
        outs = llm.generate(contexts, params)
        if name.endswith("cached"):
            assert all(o.num_cached_tokens > 0 for o in outs)
        errors = _top_errors(outs, reference)
        summary[name] = (max(errors), sum(errors) / len(errors))
    return summary


def _show(summary: dict[str, tuple[float, float]]) -> str:
    return "; ".join(f"{k} ({a:.3f}, {b:.3f})" for k, (a, b) in summary.items())


def test_fp8_log_probs_against_hf_float32_next_to_bf16(
    hf_real, prompts: list[list[int]], fp8_llm: LLM, bf16_llm: LLM
) -> None:
    """The 48 teacher-forced contexts of `test_smollm2_gpu`: the top-5 log-prob error against HF
    float32 of the engine with FP8 KV, bf16 KV, and of HF bf16; batched, then from the prefix
    cache (FP8 pages read back). E4M3 cannot meet the goal (3 mantissa bits,
    docs/notes/fp8-kv.md) and is held loosely."""
    contexts, reference, hf_errors = _teacher_forced(hf_real, prompts)
    hf_mean = sum(hf_errors) / len(hf_errors)
    runs = [("bf16 KV", bf16_llm), ("FP8 KV", fp8_llm), ("FP8 KV cached", fp8_llm)]
    summary = _context_errors(contexts, reference, runs)
    print(f"48 contexts, top-5 error vs HF float32 (max, mean): HF bf16 ({max(hf_errors):.3f}, "
          f"{hf_mean:.3f}); {_show(summary)}")  # fmt: skip
    for name in ("FP8 KV", "FP8 KV cached"):
        worst, mean = summary[name]
        # the mean catches a wrong page or scale (nats everywhere); the max is one context's
        # top-5 tail, which FP8 moved by 0.97 nats (2.4 with a bf16 model) on the CPU
        assert mean <= 4 * hf_mean + 0.05 and worst <= 4.0, (name, summary)


def test_int8_log_probs_within_goal_of_bf16(
    hf_real, prompts: list[list[int]], int8_llm: LLM, int8_torch_llm: LLM, bf16_llm: LLM
) -> None:
    """The 48 contexts with int8 KV on the flashinfer backend (prefill over dequantized pages,
    batched, then from the prefix cache): within 1.5x of bf16 KV's max and mean error (the
    issue's goal). The torch backend over the same rows is printed beside it."""
    contexts, reference, _ = _teacher_forced(hf_real, prompts)
    runs = [
        ("bf16 KV", bf16_llm), ("int8 KV", int8_llm), ("int8 KV cached", int8_llm),
        ("int8 KV torch", int8_torch_llm), ("int8 KV torch cached", int8_torch_llm),
    ]  # fmt: skip
    summary = _context_errors(contexts, reference, runs)
    print(f"48 contexts, top-5 error vs HF float32 (max, mean): {_show(summary)}")
    bf16_worst, bf16_mean = summary["bf16 KV"]
    for name in ("int8 KV", "int8 KV cached"):
        worst, mean = summary[name]
        assert worst <= GOAL * bf16_worst and mean <= GOAL * bf16_mean, (name, summary)


def _forced_decode_errors(
    hf_real,  # noqa: ANN001 - a transformers model
    prompts: list[list[int]],
    texts: list[list[int]],
    llm: LLM,
) -> tuple[float, float]:
    """Max and mean top-5 error against HF float32 of `llm`'s decode steps (the prompts as
    one batch, on pages borrowed from its KV manager), each teacher-forced on its text: every
    engine judged at the same contexts, so one engine's near-tie cannot move it onto other
    text (the first token is the prefill's and is left out)."""
    kv, runner = llm.engine.kv, llm.engine.runner
    need = sum(-(-(len(p) + TEACHER_TOKENS + 1) // runner.cfg.page_size) for p in prompts)
    pages = kv.allocate(need)
    assert pages is not None
    try:
        seqs = new_sequences(prompts, TEACHER_TOKENS - 1, pages, runner.cfg.page_size, TOP)
        forced = [[text[t] for text in texts] for t in range(TEACHER_TOKENS)]
        results = decode_steps(runner, seqs, TEACHER_TOKENS - 1, forced)
    finally:
        kv.allocator.free(pages)
    errors = []
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        ref = _hf_log_probs(hf_real, prompt + text)
        for t, result in enumerate(results, start=1):
            assert result.top_ids is not None and result.top_logprobs is not None
            row = ref[len(prompt) + t - 1]
            top = zip(result.top_ids[i][:TOP], result.top_logprobs[i][:TOP])
            errors.append(max(abs(lp - float(row[tok])) for tok, lp in top))
    return max(errors), sum(errors) / len(errors)


def test_int8_decode_log_probs_within_goal_of_bf16(
    hf_real, prompts: list[list[int]], int8_llm: LLM, int8_torch_llm: LLM, bf16_llm: LLM
) -> None:
    """Decode steps read int8 pages (flashinfer backend: the Triton kernel in the decode
    graphs; the torch backend's for comparison), all forced on bf16 KV's greedy text: within
    1.5x of bf16 KV's error."""
    params = SamplingParams(max_tokens=TEACHER_TOKENS, temperature=0.0, ignore_eos=True)
    texts = [out.token_ids for out in bf16_llm.generate(prompts, params)]
    bf16, int8, torch_int8 = (
        _forced_decode_errors(hf_real, prompts, texts, llm)
        for llm in (bf16_llm, int8_llm, int8_torch_llm)
    )
    print(f"decode steps, top-5 error vs HF float32 (max, mean): bf16 KV {bf16}, int8 KV "
          f"{int8}, int8 KV torch {torch_int8}")  # fmt: skip
    assert int8[0] <= GOAL * bf16[0] and int8[1] <= GOAL * bf16[1], (bf16, int8)


def test_int8_chat_answers_as_bf16_kv(smollm2_dir: Path, int8_llm: LLM, bf16_llm: LLM) -> None:
    """The greedy answers to 6 chat questions (first 12 tokens) with int8 KV on the flashinfer
    backend against bf16 KV's: at least 5 of 6 the same (the issue's bound)."""
    from transformers import AutoTokenizer

    from tests.unit.test_int8_kv import CHATS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = []
    for question in CHATS:
        msg = [{"role": "user", "content": question}]
        ids = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    want = bf16_llm.generate(chats, greedy(TEACHER_TOKENS))
    got = int8_llm.generate(chats, greedy(TEACHER_TOKENS))
    same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
    print(f"int8 KV (flashinfer) chat answers as bf16 KV's: {same} of 6; "
          + " | ".join(f"{a.text!r} / {b.text!r}" for a, b in zip(got, want)))  # fmt: skip
    assert same >= 5, [(a.text, b.text) for a, b in zip(got, want)]


@pytest.mark.parametrize("kernel", ["triton", "xqa"])
def test_fp8_decode_log_probs_against_hf_float32(
    hf_real, prompts: list[list[int]], smollm2_dir: Path, bf16_llm: LLM, kernel: str
) -> None:
    """The decode steps' top-5 log-probs with FP8 KV, read by each FP8 decode kernel
    (`KernelConfig.fp8_decode_kernel`), against HF float32 teacher-forced on bf16 KV's greedy
    text, next to bf16 KV's (the contexts above are prefills: they never reach these
    kernels)."""
    fp8 = LLM(
        str(smollm2_dir), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
        kv_cache_memory_gb=1, kv_cache_dtype="fp8_e4m3", kernels={"fp8_decode_kernel": kernel},
    )  # fmt: skip
    params = SamplingParams(max_tokens=TEACHER_TOKENS, temperature=0.0, ignore_eos=True)
    texts = [out.token_ids for out in bf16_llm.generate(prompts, params)]
    summary = {name: _forced_decode_errors(hf_real, prompts, texts, llm)
               for name, llm in (("bf16 KV", bf16_llm), (f"FP8 KV, {kernel}", fp8))}  # fmt: skip
    print("decode steps, top-5 error vs HF float32 (max, mean): "
          + "; ".join(f"{k} ({a:.3f}, {b:.3f})" for k, (a, b) in summary.items()))  # fmt: skip
    worst, mean = summary[f"FP8 KV, {kernel}"]
    assert mean <= 4 * summary["bf16 KV"][1] + 0.05 and worst <= 4.0, summary


AGREE_TOKENS = 32


def test_fp8_greedy_agrees_with_bf16_kv(
    prompts: list[list[int]], fp8_llm: LLM, bf16_llm: LLM
) -> None:
    """The first 32 greedy tokens with FP8 KV against bf16 KV, over the chat question, plain
    text, code and short prompts: tokens equal before the first difference."""
    tok = fp8_llm.tokenizer
    varied = [*prompts, *(tok.encode(p) for p in TEXT_PROMPTS)]
    want = [o.token_ids for o in bf16_llm.generate(varied, greedy(AGREE_TOKENS))]
    got = [o.token_ids for o in fp8_llm.generate(varied, greedy(AGREE_TOKENS))]
    agreed = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
              for g, w in zip(got, want)]  # fmt: skip
    print(
        f"FP8 vs bf16 KV, greedy tokens equal before the first difference: {agreed} "
        f"(mean {sum(agreed) / len(agreed):.1f} of {AGREE_TOKENS})"
    )
    # a near-tie may split one or two texts at once; most run on for many tokens
    assert sum(a >= 1 for a in agreed) >= len(varied) - 2, agreed
    assert sum(agreed) >= len(varied) * AGREE_TOKENS // 4, agreed
