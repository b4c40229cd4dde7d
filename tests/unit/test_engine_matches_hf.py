"""The engine's greedy tokens equal HF transformers', batched, for every model family we serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hf_greedy, hf_greedy_batch, make_random_checkpoint
from workers import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colors:",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "Water boils at a temperature of",
]
NEW_TOKENS = 48
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_reference(hf_smollm2, smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, hf_greedy_batch(hf_smollm2, prompts, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_greedy_batch_equals_hf(smollm2_reference, page_size: int) -> None:
    prompts, expected = smollm2_reference
    llm = LLM(page_size=page_size, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref, f"diverged for {llm.tokenizer.decode(prompt)!r}"
        assert out.finish_reason == "length"


def test_smollm2_penalties_and_logit_bias_equal_hf_processors(
    smollm2_reference, hf_smollm2
) -> None:
    """Greedy under repetition penalty, then under logit bias, against HF's own processors
    (`RepetitionPenaltyLogitsProcessor`, `SequenceBiasLogitsProcessor`) on HF's logits."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    prompts = smollm2_reference[0][:3]
    plain = smollm2_reference[1][:3]
    # Push away each prompt's favourite token: the bias applies to all three rows.
    bias = {plain[0][0]: -10.0, plain[1][1]: -10.0, plain[2][2]: 3.0}
    cases = [
        (dict(repetition_penalty=1.3), RepetitionPenaltyLogitsProcessor(1.3)),
        (dict(logit_bias={str(t): b for t, b in bias.items()}),
         SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})),
    ]  # fmt: skip
    llm = LLM(enable_prefix_caching=False)
    for fields, processor in cases:
        # 12 tokens: the penalty first changes these prompts' greedy text at tokens 3, 8 and 9
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **fields)
        outs = llm.generate(prompts, params)
        wants = hf_greedy_batch(hf_smollm2, prompts, 12, LogitsProcessorList([processor]))
        for out, want, base in zip(outs, wants, plain):
            assert out.token_ids == want, fields
            assert want != base[:12]  # the rule changed the greedy text


@pytest.mark.parametrize("rows_at_once", [512, 3])
def test_smollm2_prompt_logprobs_equal_hf(
    smollm2_reference, hf_smollm2, rows_at_once: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt token's logprob given the tokens before it, and the top 2 there, as HF's
    log-softmax over one forward of the prompt; in prefill chunks of 16 tokens, through the LM
    head in one piece or in pieces of 3 rows, and again for prompts whose KV is cached (prompt
    logprobs recompute them)."""
    import torch

    from workers.engine import model_runner as engine

    monkeypatch.setattr(engine, "PROMPT_ROWS_AT_ONCE", rows_at_once)
    prompts = smollm2_reference[0][:4]
    llm = LLM(max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    for _ in range(2):
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            with torch.inference_mode():
                ref = hf_smollm2(torch.tensor([prompt])).logits[0].log_softmax(-1)
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            assert len(out.prompt_logprobs) == len(prompt) and out.num_cached_tokens == 0
            for t, entry in enumerate(out.prompt_logprobs[1:]):
                assert entry is not None and entry.token_id == prompt[t + 1]
                assert abs(entry.logprob - float(ref[t, prompt[t + 1]])) < 1e-4
                assert list(entry.top) == ref[t].topk(2).indices.tolist()
                # its rank: 1 + how many tokens are more likely (HF's values within 1e-4)
                surely, maybe = (int((ref[t] > entry.logprob + d).sum()) for d in (1e-4, -1e-4))
                assert entry.rank is not None and surely + 1 <= entry.rank <= maybe


def test_smollm2_answers_the_capital_of_france() -> None:
    llm = LLM()
    [out] = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=20, temperature=0),
    )
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


RANDOM_MODELS = {
    "llama3": (
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-tied-mqa": ("LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
}


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_random_weight_family_equals_hf(
    name: str, page_size: int, tmp_path: Path, smollm2_dir: Path
) -> None:
    import transformers

    arch, overrides = RANDOM_MODELS[name]
    ckpt = make_random_checkpoint(tmp_path, smollm2_dir, arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(ckpt).eval()
    prompts = [[(7 * i + 13 * j) % 4000 + 5 for j in range(5 + 9 * i)] for i in range(4)]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(str(ckpt), page_size=page_size, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
