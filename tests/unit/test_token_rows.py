"""Prefill chunks laid out as decode rows (one new token a row, each attending to its sequence up
to itself), the layout that lets a decode CUDA graph run steps of few prompt tokens: the same
logits as the chunks laid out as one row each. SmolLM2's real weights, float32, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.protocol import SamplingParams
from workers.scheduler.step import StepInput
from workers.sequence import Sequence

PAGE = 4  # several pages a row
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def runner(smollm2_dir: Path) -> ModelRunner:
    cfg = EngineConfig(
        model=str(smollm2_dir), device="cpu", dtype="float32", page_size=PAGE, num_kv_pages=64
    )
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _sequence(tokenizer, name: str, text: str, first_page: int) -> Sequence:  # noqa: ANN001
    ids = list(tokenizer(text)["input_ids"])
    seq = Sequence(name, ids, len(ids), GREEDY, None)
    seq.pages = list(range(first_page, first_page + -(-len(ids) // PAGE)))
    return seq


def _logits(
    runner: ModelRunner, step: StepInput, token_rows: bool, prefixes: dict[Sequence, int]
) -> torch.Tensor:
    """The step's logits from a pool holding only `prefixes` (tokens of a sequence computed
    before, by a step of its own): each layout writes its own K/V, and reads it back."""
    runner.pool.pages.zero_()
    for seq, n in prefixes.items():
        seq.num_computed_tokens = 0
        runner.execute(StepInput([seq], [n]))
        seq.num_computed_tokens = n
    plan = runner.build_plan(step, token_rows, None)
    assert plan.rows == [i for i in range(len(step.seqs)) if step.samples(i)]
    if token_rows:
        assert plan.q_lens == [1] * sum(step.num_new_tokens)
    logits = runner.run_plan(plan).logits
    assert logits is not None
    return logits


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))
    torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=2e-4, rtol=0)


def test_a_whole_prompt_as_token_rows_gives_its_logits(runner: ModelRunner, tokenizer) -> None:  # noqa: ANN001
    seq = _sequence(
        tokenizer, "a", "The capital of France is Paris, and the capital of Italy is", 1
    )
    step = StepInput([seq], [seq.num_tokens])
    _assert_same(_logits(runner, step, False, {}), _logits(runner, step, True, {}))


def test_a_mixed_step_as_token_rows_gives_its_logits(runner: ModelRunner, tokenizer) -> None:  # noqa: ANN001
    """A chunk after a cached prefix, a decode row and a chunk that samples nothing, together."""
    cached = _sequence(tokenizer, "cached", "Once upon a time, in a small village by the sea,", 20)
    decoding = _sequence(tokenizer, "decoding", "def fibonacci(n):\n    return", 40)
    partial = _sequence(tokenizer, "partial", "The quick brown fox jumps over the lazy dog", 50)
    prefixes = {cached: 9, decoding: decoding.num_tokens - 1}
    for seq, n in prefixes.items():
        seq.num_computed_tokens = n
    step = StepInput(
        [cached, decoding, partial], [cached.num_tokens - 9, 1, partial.num_tokens - 3]
    )
    assert [step.samples(i) for i in range(3)] == [True, True, False]
    by_chunk = _logits(runner, step, False, prefixes)
    _assert_same(by_chunk, _logits(runner, step, True, prefixes))
