"""SmolLM2-135M-Instruct's real weights: the engine on a GPU against HF transformers on it.

float32 with the torch backend gives HF's greedy tokens exactly; bfloat16 with FlashInfer, CUDA
graphs and overlap scheduling answers the chat question as HF does, every token within bf16's
reach of HF's float32 best.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import hf_greedy_gpu, hf_judge
from tests.gpu.test_engine_gpu import LOGIT_SLACK, PROMPTS, greedy
from workers import LLM

pytestmark = pytest.mark.gpu

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_real(smollm2_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.to("cuda").eval()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def chat_prompt(smollm2_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_float32_engine_gives_hf_greedy_tokens(
    smollm2_dir: Path, hf_real, chat_prompt: list[int]
) -> None:
    prompts = [chat_prompt, *PROMPTS[:3]]
    expected = [hf_greedy_gpu(hf_real, p, NEW_TOKENS) for p in prompts]
    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        kv_cache_memory_gb=1,
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))] == expected


def test_bfloat16_graphs_answer_paris_like_hf(
    smollm2_dir: Path, hf_real, chat_prompt: list[int]
) -> None:
    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
        kv_cache_memory_gb=1,
    )
    assert llm.engine.runner.graphs is not None and llm.engine.overlap
    out = llm.generate([chat_prompt], greedy(NEW_TOKENS))[0]
    assert out.text.startswith("The capital of France is Paris.")
    _, shortfall = hf_judge(hf_real, chat_prompt, out.token_ids)
    assert float(shortfall.max()) < LOGIT_SLACK, f"token far from HF's best: {shortfall}"
