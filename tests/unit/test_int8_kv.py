"""The int8 KV cache (a float32 scale per token and head, inside the row): its rounding, the
torch attention over it, its pages through the disaggregated hand-off, and SmolLM2's accuracy
against the bf16 KV cache (its mean error within 1.5x of that cache's; docs/notes/fp8-kv.md)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tests.engine_checks import engine_pair, prefill_then_decode
from workers import LLM, SamplingParams
from workers.attention.base import AttentionBatch
from workers.attention.torch_ref import TorchAttention
from workers.config import EngineConfig
from workers.kvcache.int8_rows import dequantize_rows, hadamard, quantize_rows
from workers.kvcache.pool import KVPool
from workers.protocol import GenerateRequest, KVLayout

INT8 = dict(kv_cache_dtype="int8")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_rows_round_to_half_a_step_of_their_own_scale() -> None:
    """Each row is rounded in its rotated form: its error's norm is at most half a step of its
    own scale per element (the rotation keeps norms), whatever the row's magnitude."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[0, 0] = 0.0  # a zero row: scale 0, zeros back
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    h = hadamard(64, torch.device("cpu"))
    assert h is not None
    step = (x @ h).abs().amax(-1) / 127
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert ((back - x).norm(dim=-1) <= step / 2 * 64**0.5 * (1 + 1e-5) + 1e-30).all()


def test_the_rotation_is_exact_and_spreads_an_outlier_channel() -> None:
    h = hadamard(64, torch.device("cpu"))
    assert h is not None and hadamard(80, torch.device("cpu")) is None  # not a power of 2
    torch.testing.assert_close(h @ h, torch.eye(64), atol=1e-6, rtol=0)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 40  # one large channel, as K has: unrotated, it sets every row's step
    scale = x.abs().amax(-1, keepdim=True) / 127
    plain = (x - (x / scale).round() * scale).norm()
    assert (x - dequantize_rows(quantize_rows(x), torch.float32)).norm() < plain / 3


def test_torch_attention_over_int8_pages_is_attention_over_their_values() -> None:
    """Paged attention over an int8 pool (decode and prefill rows, GQA, several pages) equals
    SDPA over the dequantized K/V gathered by hand: reads use each row's own scale."""
    gen = torch.Generator().manual_seed(1)
    layout = KVLayout(num_layers=1, page_size=4, num_kv_heads=2, head_dim=16, dtype="int8")
    pool = KVPool(layout, 12, "cpu", torch.float32)
    attn = TorchAttention(pool, num_q_heads=4, scale=16**-0.5)
    q_lens, kv_lens = [1, 5], [7, 9]  # a decode row and a prefill chunk
    table = torch.tensor([[3, 5, 0], [6, 2, 8]], dtype=torch.int32)
    positions = [range(kv - q, kv) for q, kv in zip(q_lens, kv_lens)]
    slots = [(int(table[i, p // 4]), p % 4) for i, ps in enumerate(positions) for p in ps]
    history = [(i, p) for i, kv in enumerate(kv_lens) for p in range(kv)]
    old = [(i, p) for i, p in history if p < kv_lens[i] - q_lens[i]]
    k_all = {ip: torch.randn(2, 16, generator=gen) * 4 for ip in history}
    v_all = {ip: torch.randn(2, 16, generator=gen) for ip in history}
    for i, p in old:  # the earlier tokens, already in their pages
        pool.layer(0)[table[i, p // 4], 0, p % 4] = quantize_rows(k_all[(i, p)])
        pool.layer(0)[table[i, p // 4], 1, p % 4] = quantize_rows(v_all[(i, p)])
    new = [(i, p) for i, ps in enumerate(positions) for p in ps]
    batch = AttentionBatch(
        q_lens, kv_lens, table, torch.tensor([s[0] for s in slots]),
        torch.tensor([s[1] for s in slots]),
    )  # fmt: skip
    attn.plan(batch)
    q = torch.randn(len(new), 4, 16, generator=gen)
    out = attn.forward(
        0, q, torch.stack([k_all[n] for n in new]), torch.stack([v_all[n] for n in new])
    )
    for row, (i, p) in enumerate(new):
        seen = range(p + 1)
        keys = dequantize_rows(
            torch.stack([quantize_rows(k_all[(i, t)]) for t in seen]), torch.float32
        )
        vals = dequantize_rows(
            torch.stack([quantize_rows(v_all[(i, t)]) for t in seen]), torch.float32
        )
        k = keys.transpose(0, 1).repeat_interleave(2, 0)  # [Hq, t, D]
        v = vals.transpose(0, 1).repeat_interleave(2, 0)
        want = F.scaled_dot_product_attention(q[row][:, None], k, v, scale=16**-0.5)[:, 0]
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)


def test_int8_runs_on_flashinfer_by_default_on_cuda() -> None:
    """`auto` reads int8 pages with the backend it picks for a bf16 cache (FlashInfer's on a GPU
    where it is installed: a Triton decode kernel, dequantized pages for prefill), with the
    torch backend on the CPU or when asked for."""
    cuda = torch.device("cuda")
    bf16_cache = EngineConfig(**{**INT8, "kv_cache_dtype": "auto"})
    want = bf16_cache.resolved_backend(cuda, torch.bfloat16, 64)
    assert EngineConfig(**INT8).resolved_backend(cuda, torch.bfloat16, 64) == want
    assert EngineConfig(**INT8).resolved_backend(torch.device("cpu"), torch.float32) == "torch"
    asked = EngineConfig(attention_backend="torch", **INT8)
    assert asked.resolved_backend(cuda, torch.bfloat16, 64) == "torch"
    # a GQA group wider than the int8 kernel's rows (32 query heads on one KV head): torch
    assert EngineConfig(**INT8).resolved_backend(cuda, torch.bfloat16, 64, 32) == "torch"
    assert bf16_cache.resolved_backend(cuda, torch.bfloat16, 64, 32) == want


def test_int8_pages_carry_their_scales_across_the_handoff(tiny_llama: str) -> None:
    """Prefill and decode engines in one process, NIXL over DRAM: the scales ride inside the
    pages (head_dim + 4 bytes a row) and the decode gives the colocated int8 engine's tokens."""
    cfg = EngineConfig(model=tiny_llama, num_kv_pages=32, page_size=16, **INT8)
    with engine_pair(cfg) as (prefill, decode):
        ids = list(range(500, 540))
        req = GenerateRequest(request_id="h", prompt_token_ids=ids, params=GREEDY)
        tokens = prefill_then_decode(prefill, decode, req)
        stats = decode.stats()
        assert stats.num_recomputed == 0 and stats.kv_pages_read == 3
        layout = prefill.agent.layout
        assert stats.nixl_bytes_transferred == 3 * layout.page_bytes
        assert layout.page_bytes * layout.head_dim == (
            layout.model_copy(update={"dtype": "float32"}).page_bytes // 4 * layout.row_width
        )
        [ref] = LLM(tiny_llama, num_kv_pages=32, page_size=16, **INT8).generate([ids], GREEDY)
        assert tokens == ref.token_ids


# -- SmolLM2's real weights ----------------------------------------------------------------------

ANSWER_TOKENS = 12  # further on, bf16's own near-ties split answers of the same content
CHATS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
]


def _top5_errors(llm: LLM, texts: list[tuple[int, list[int]]], reference: list) -> list[float]:
    outs = llm.generate([t for _, t in texts], SamplingParams(max_tokens=1, prompt_logprobs=5))
    tops = [e.top for (start, _), o in zip(texts, outs) for e in o.prompt_logprobs[start:]]  # type: ignore[index]
    return [max(abs(lp - float(ref[t])) for t, lp in top.items())
            for top, ref in zip(tops, reference, strict=True)]  # fmt: skip


def test_smollm2_int8_kv_error_against_bf16_kv(hf_smollm2, smollm2_dir: Path) -> None:
    """Teacher-forced on HF float32's greedy text at the 48 contexts of
    tests/gpu/test_smollm2_gpu.py, top-5 log-prob error against HF float32:
    - a bf16 model (as served on a GPU): int8 KV's mean error within 1.5x of the bf16 KV cache's;
    - a float32 model, where int8 is the only rounding: its worst context stays below the bf16
      model's worst with bf16 KV, and greedy chat answers are the float32 KV cache's in at
      least 5 of 6 (the issue's bar; which CPU runs it moves float32 near-ties: 6 on some, 5
      on others).
    Not asserted: the bf16 model's max and its answers, which its own near-ties decide (a 12-bit
    cache moves that max anywhere in 0.27-0.47 nats; docs/notes/fp8-kv.md)."""
    from transformers import AutoTokenizer

    from tests.gpu.test_smollm2_gpu import CHAT, TEXTS
    from tests.unit.test_fp8_kv import TEACHER

    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    def chat(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    texts, reference = [], []
    for prompt, greedy in zip(
        [chat(CHAT[0]["content"]), *(tok(t)["input_ids"] for t in TEXTS)], TEACHER
    ):
        texts.append((len(prompt), prompt + greedy))
        with torch.inference_mode():
            fp32 = hf_smollm2(torch.tensor([texts[-1][1]])).logits[0].double().log_softmax(-1)
        reference += list(fp32[len(prompt) - 1 : -1])
    answers = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    summary, said = {}, {}
    for model_dtype in ("bfloat16", "float32"):
        for kv in ("auto", "int8"):
            llm = LLM(dtype=model_dtype, kv_cache_dtype=kv)
            errors = _top5_errors(llm, texts, reference)
            summary[model_dtype, kv] = (max(errors), sum(errors) / len(errors))
            outs = llm.generate([chat(c) for c in CHATS], answers)
            said[model_dtype, kv] = [o.token_ids for o in outs]
    same = sum(a == b for a, b in zip(said["float32", "int8"], said["float32", "auto"]))
    print(f"48 contexts, top-5 error vs HF float32 (max, mean): {summary}; float32 model, "
          f"first {ANSWER_TOKENS} answer tokens as float32 KV's: {same} of 6")  # fmt: skip
    assert summary["bfloat16", "int8"][1] <= 1.5 * summary["bfloat16", "auto"][1], summary
    assert summary["float32", "int8"][0] < summary["bfloat16", "auto"][0], summary
    assert same >= 5, said
