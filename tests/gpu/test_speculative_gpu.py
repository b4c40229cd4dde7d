"""Speculative decoding on a GPU with SmolLM2's real weights.

float32 with the torch backend: greedy outputs with speculation are exactly those without, for
both methods (the draft model is SmolLM2 itself). bfloat16 with FlashInfer and CUDA graphs: the
verify steps replay the token-row graphs, and greedy outputs are those without speculation up
to a near-tie of bf16's rounding (a verify step's GEMMs have k + 1 rows where a decode step's
have one, which may round differently: `docs/speculative-decoding.md`). A mixed batch (seeded
sampling, penalties, stop strings, logprobs) ends with every page back and seeds reproduce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine_checks import drain_and_check_released
from tests.gpu.conftest import count_replays
from workers import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in "
    "his log: wind from the west, a light rain, the sea calm. Then he made tea and waited."
)
PROMPTS = [
    f"Copy this text exactly.\n{PASSAGE}\nCopy:\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Once upon a time, in a small village nestled between two mountains, there lived",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
NEAR_TIE = 0.1  # nats between the reference's two best tokens where bf16 may pick either


def spec(method: str, smollm2_dir: Path, k: int = 4) -> dict[str, Any]:
    out: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        out["model"] = str(smollm2_dir)
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_float32_greedy_outputs_are_the_target_alone(smollm2_dir: Path, method: str) -> None:
    options = dict(device="cuda", dtype="float32", attention_backend="torch",
                   kv_cache_memory_gb=1)  # fmt: skip
    want = LLM(str(smollm2_dir), **options).generate(PROMPTS, GREEDY)
    llm = LLM(str(smollm2_dir), speculative=spec(method, smollm2_dir), **options)
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.num_accepted_tokens for o in got) > 0
    drain_and_check_released(llm.engine)


@pytest.fixture(scope="module")
def bf16_options() -> dict[str, Any]:
    return dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                kv_cache_memory_gb=1)  # fmt: skip


def test_bf16_verify_steps_replay_graphs_and_keep_greedy_tokens(
    smollm2_dir: Path, bf16_options: dict[str, Any]
) -> None:
    reference = LLM(str(smollm2_dir), **bf16_options).generate(
        PROMPTS, GREEDY.model_copy(update={"logprobs": 2})
    )
    llm = LLM(str(smollm2_dir), speculative=spec("ngram", smollm2_dir), **bf16_options)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not llm.engine.overlap
    replays = count_replays(graphs)
    got = llm.generate(PROMPTS, GREEDY)
    assert len(replays) == llm.engine.step_tokens.buckets[-1]  # every step, verify steps too
    assert sum(o.num_accepted_tokens for o in got) > 0
    for g, want in zip(got, reference, strict=True):
        assert want.logprobs is not None
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, want.token_ids)) if a != b),
                    None)  # fmt: skip
        if same is not None:  # only where bf16 could have gone either way
            best = sorted(want.logprobs[same].top.values(), reverse=True)
            assert best[0] - best[1] < NEAR_TIE, (same, best)
    drain_and_check_released(llm.engine)


def test_bf16_mixed_batch_frees_every_page_and_seeds_reproduce(
    smollm2_dir: Path, bf16_options: dict[str, Any]
) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=40, logprobs=1)
        if i % 2
        else SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n"],
                            repetition_penalty=1.1 if i % 4 else 1.0)
        for i in range(16)
    ]  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    options = dict(speculative=spec("draft_model", smollm2_dir, k=3), **bf16_options)
    first = LLM(str(smollm2_dir), **options).generate(prompts, params)
    llm = LLM(str(smollm2_dir), **options)  # a fresh engine computes exactly the same
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.finish_reason in ("stop", "length") for o in first)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert stats.generation_tokens == sum(len(o.token_ids) for o in again)
    drain_and_check_released(llm.engine)
    spec_state = llm.engine.spec
    assert spec_state is not None and spec_state.draft is not None
    allocator = spec_state.draft.kv.allocator
    assert allocator.num_free == allocator.num_usable
