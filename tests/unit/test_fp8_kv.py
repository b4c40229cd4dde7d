"""FP8 KV cache on the CPU (torch backend, which dequantizes): quantization, the pool's size,
checkpoint scales, the serving mechanics (chunked prefill, prefix cache, preemption, the NIXL
hand-off) on the tiny random Llama, and accuracy on SmolLM2's real weights."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from router.backend import RoleStats
from router.metrics import Metrics
from tests.engine_checks import drain_and_check_released, engine_pair, prefill_then_decode
from workers import LLM, SamplingParams
from workers.config import EngineConfig
from workers.disagg.decode import DecodeEngine
from workers.engine_stats import EngineStats
from workers.kvcache.kv_dtype import FP8_MAX, KVScales, dequantize, quantize
from workers.protocol import GenerateRequest, KVLayout
from workers.transfer import KVLayoutMismatchError
from workers.transfer.head_slices import head_sources

FP8 = dict(kv_cache_dtype="fp8_e4m3")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_quantize_saturates_and_round_trips_within_fp8_precision() -> None:
    x = torch.tensor([0.3, -1.7, 5.0, 900.0, -2000.0])
    for scale in (1.0, 0.25):
        back = dequantize(quantize(x, torch.float8_e4m3fn, scale), torch.float32, scale)
        assert torch.isfinite(back).all()  # a plain cast past 448 gives NaN
        assert back[3] == FP8_MAX * scale and back[4] == -FP8_MAX * scale
        assert torch.allclose(back[:3], x[:3], rtol=1 / 16)  # 3 mantissa bits
    assert quantize(x, torch.bfloat16, 1.0).dtype == torch.bfloat16


def test_fp8_pool_holds_twice_the_pages_of_bf16_in_the_same_memory(tiny_llama: str) -> None:
    bf16 = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory_gb=0.01).engine.runner.pool
    fp8 = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory_gb=0.01, **FP8).engine.runner.pool
    assert fp8.pages.dtype == torch.float8_e4m3fn and fp8.compute_dtype == torch.bfloat16
    assert fp8.layout.page_bytes * 2 == bf16.layout.page_bytes
    assert fp8.num_pages == 2 * bf16.num_pages and fp8.num_tokens > 2 * bf16.num_tokens - 32


def test_checkpoint_kv_scales_are_read_and_used(
    tiny_llama: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "scaled"
    shutil.copytree(tiny_llama, model)
    k, v = (0.5, 0.25), (0.125, 2.0)
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s[i])
               for i in range(2) for n, s in (("k", k), ("v", v))},
              model / "kv_scales.safetensors")  # fmt: skip
    with caplog.at_level("WARNING", logger="workers.kvcache.kv_dtype"):
        llm = LLM(str(model), **FP8)
        assert "scale of 1.0" not in caplog.text  # the checkpoint's scales: no warning
        LLM(tiny_llama, **FP8)
    # as vLLM, a warning where FP8 falls back to 1.0, pointing at int8
    assert caplog.text.count("scale of 1.0") == 1 and "int8" in caplog.text
    assert llm.engine.runner.pool.scales == KVScales(k, v)
    [out] = llm.generate([[1, 2, 3, 4, 5]], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens
    assert LLM(str(model)).engine.runner.pool.scales == KVScales.unit(2)  # auto: unused


def test_chunked_prefill_prefix_cache_and_preemption_keep_fp8_tokens(tiny_llama: str) -> None:
    """The same greedy tokens as one unchunked, uncached pass over a large FP8 pool: chunks of 16
    tokens, a second round from the prefix cache, and a pool small enough to preempt."""
    system = list(range(100, 140))
    prompts = [system + [200 + i, 300 + i, 400 + i] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=4096, **FP8)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    # 10 shared pages and 1 more each at admission; 5 more each by the end: 30 > 23 usable.
    llm = LLM(tiny_llama, page_size=4, num_kv_pages=24, max_num_batched_tokens=16, **FP8)
    for attempt in range(2):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, attempt
    assert all(o.num_cached_tokens >= 40 for o in outs)
    assert llm.engine.stats().num_preemptions > 0
    drain_and_check_released(llm.engine)


def test_fp8_pages_cross_the_handoff_as_they_are(tiny_llama: str) -> None:
    """Prefill and decode engines in one process, NIXL over DRAM: the decode reads half the
    bytes a bf16 pool would and gives the colocated FP8 engine's tokens."""
    cfg = EngineConfig(model=tiny_llama, num_kv_pages=32, page_size=16, **FP8)
    with engine_pair(cfg) as (prefill, decode):
        ids = list(range(500, 540))
        req = GenerateRequest(request_id="h", prompt_token_ids=ids, params=GREEDY)
        tokens = prefill_then_decode(prefill, decode, req)
        stats = decode.stats()
        assert stats.num_recomputed == 0 and stats.kv_pages_read == 3
        bf16_page = prefill.agent.layout.model_copy(update={"dtype": "bfloat16"}).page_bytes
        assert stats.nixl_bytes_transferred * 2 == 3 * bf16_page
        [ref] = LLM(tiny_llama, num_kv_pages=32, page_size=16, **FP8).generate([ids], GREEDY)
        assert tokens == ref.token_ids
        # A decode pool storing bf16 refuses these pages, saying what to set.
        with pytest.raises(KVLayoutMismatchError, match="kv_cache_dtype"):
            decode.agent.check_layout(decode.agent.layout, "p", expected=bf16_layout(decode))


def bf16_layout(engine: DecodeEngine) -> KVLayout:
    return engine.agent.layout.model_copy(update={"dtype": "bfloat16"})


def test_heterogeneous_tp_refuses_a_kv_dtype_mismatch() -> None:
    fp8 = KVLayout(num_layers=2, page_size=16, num_kv_heads=1, head_dim=8, dtype="float8_e4m3fn")
    bf16 = fp8.model_copy(update={"dtype": "bfloat16", "num_kv_heads": 2})
    with pytest.raises(KVLayoutMismatchError, match="kv_cache_dtype"):
        head_sources(bf16, [fp8, fp8.model_copy(update={"kv_head_offset": 1})])


def test_metrics_say_how_many_kv_tokens_fit() -> None:
    stats = EngineStats(
        num_running=0, num_waiting=0, kv_pages_total=100, kv_pages_used=0, kv_pages_pinned=0,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
        prompt_tokens_computed=0, generation_tokens=0,
    )  # fmt: skip
    metrics = Metrics("m", cache_info={"block_size": "16", "cache_dtype": "fp8_e4m3"})
    text = metrics.render([RoleStats("decode", stats)]).decode()
    assert re.search(r'pdserve:kv_cache_tokens\{[^}]*"decode"[^}]*\} 1600\.0', text), text
    assert 'cache_dtype="fp8_e4m3"' in text


# -- SmolLM2's real weights ----------------------------------------------------------------------

TOP = 5
# HF float32's first 12 greedy tokens after each prompt of tests/gpu/test_smollm2_gpu.py (the
# chat question, then TEXTS): with the prompts, the 48 contexts of its bf16 check. Held here
# (HF's greedy loop costs ~10 s of CPU); the test checks they still are HF's argmax.
TEACHER = [
    [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690],
    [7042, 30, 198, 198, 504, 2988, 314, 42, 378, 3575, 282, 4649],
    [3725, 198, 198, 1348, 6230, 2925, 253, 35881, 2424, 288, 7529, 260],
    [761, 5636, 650, 1029, 288, 2733, 260, 3468, 3668, 534, 21244, 30],
]
# HF bf16's top-5 error at these contexts (measured once, as the GPU test measures it each run):
# max 0.352, mean 0.134 nats. FP8 (3 mantissa bits) errs more: max 0.967-1.02, mean 0.297-0.327
# on two CPUs (docs/fp8_kv_cache.md); a wrong page or scale errs by nats. The max is taken over
# the tokens HF gives a log-prob of at least TAIL: further out, where a near-certain next token
# leaves the top-5 tail at -12 to -16 nats, one entry moved by 2.3 nats on one CPU and not on
# another (float rounding across a quantization step).
MAX_ERROR, MEAN_ERROR, TAIL = 2.0, 0.45, -10.0


def test_smollm2_fp8_log_probs_stay_within_fp8_reach(hf_smollm2, smollm2_dir: Path) -> None:
    """Teacher-forced on HF float32's greedy text at the 48 contexts of the GPU bf16 check: the
    FP8-KV engine's top-5 log-probs against HF float32's, and its top-1 against HF's token."""
    from transformers import AutoTokenizer

    from tests.gpu.test_smollm2_gpu import CHAT, TEXTS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    texts, reference = [], []
    for prompt, greedy in zip([chat, *(tok(t)["input_ids"] for t in TEXTS)], TEACHER):
        texts.append((len(prompt), prompt + greedy))
        with torch.inference_mode():
            fp32 = hf_smollm2(torch.tensor([texts[-1][1]])).logits[0].double().log_softmax(-1)
        assert fp32[len(prompt) - 1 : -1].argmax(-1).tolist() == greedy
        reference += list(fp32[len(prompt) - 1 : -1])
    # Prompt log-probs: the engine's distribution after each context, all of a text in one pass.
    params = SamplingParams(max_tokens=1, prompt_logprobs=TOP)
    outs = LLM(**FP8).generate([text for _, text in texts], params)
    tops = []
    for (start, _), out in zip(texts, outs):
        assert out.prompt_logprobs is not None
        tops += [entry.top for entry in out.prompt_logprobs[start:] if entry is not None]
    gaps = [[(abs(lp - float(ref[t])), float(ref[t])) for t, lp in top.items()]
            for top, ref in zip(tops, reference, strict=True)]  # fmt: skip
    errors = [max(e for e, _ in g) for g in gaps]
    head = [max(e for e, r in g if r >= TAIL) for g in gaps]  # the top-1 is always there
    teacher = [t for greedy in TEACHER for t in greedy]
    same = sum(max(top, key=top.__getitem__) == t for top, t in zip(tops, teacher))
    mean = sum(errors) / len(errors)
    print(f"48 contexts: FP8 KV top-5 error max {max(head):.3f} (log-prob >= {TAIL}), "
          f"{max(errors):.3f} (all), mean {mean:.3f}, top-1 as HF float32's at {same}")  # fmt: skip
    assert len(errors) == 48 and mean <= MEAN_ERROR and max(head) <= MAX_ERROR, gaps
    assert same >= 44
