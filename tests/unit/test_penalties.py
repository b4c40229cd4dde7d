"""Logit bias and penalties: the batched tensors equal a row-by-row reading of vLLM's rules."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from workers.protocol import SamplingParams
from workers.sampling.penalties import LogitAdjustments, adjusts_logits
from workers.sampling.sampler import SamplingBatch, sample

VOCAB = 50


def reference(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, token by token: bias, then repetition, frequency and presence penalties."""
    x = logits.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    for token in range(len(x)):
        if token in prompt or token in output:
            x[token] = (
                x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
            )
        count = output.count(token)
        x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def random_case(seed: int) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    params, prompts, outputs = [], [], []
    for row in range(6):
        if row % 3 == 2:
            params.append(SamplingParams())  # untouched rows sit between adjusted ones
        else:
            params.append(
                SamplingParams(
                    repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
                    frequency_penalty=rng.uniform(-2, 2),
                    presence_penalty=rng.uniform(-2, 2),
                    logit_bias={str(rng.randrange(VOCAB)): rng.uniform(-100, 100)},
                )
            )
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))])
        outputs.append([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))])
    return params, prompts, outputs


@pytest.mark.parametrize("seed", range(5))
def test_batched_adjustments_equal_the_row_by_row_rules(seed: int) -> None:
    params, prompts, outputs = random_case(seed)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    before = logits.clone()
    adjust = LogitAdjustments.build(params, prompts, outputs, VOCAB)
    assert adjust is not None
    got = adjust.apply(logits)
    assert torch.equal(logits, before)  # a new tensor; the raw logits stay for logprobs
    for row, p in enumerate(params):
        want = reference(logits[row], p, prompts[row], outputs[row])
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-4)


def test_a_pending_token_is_taken_from_the_device() -> None:
    """With overlap scheduling the newest output token is still on the device: counted the same
    as if it were in the output list."""
    params, prompts, outputs = random_case(7)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(7))
    sampled = torch.tensor([11, 42, 5])  # the step in flight's ids; rows 0 and 3 pending
    pending: list[int | None] = [2, None, None, 1, None, None]
    late = LogitAdjustments.build(params, prompts, outputs, VOCAB, in_flight=(sampled, pending))
    full = [o + [int(sampled[p])] if p is not None else o for o, p in zip(outputs, pending)]
    known = LogitAdjustments.build(params, prompts, full, VOCAB)
    assert late is not None and known is not None
    assert torch.equal(late.apply(logits), known.apply(logits))


def test_greedy_and_sampling_use_the_adjusted_logits_and_raw_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [SamplingParams(logit_bias={"1": 5.0}), SamplingParams()]
    adjust = LogitAdjustments.build(params, [[0], [0]], [[], []], 3)
    rules = torch.tensor([[0.0, 0.0], [0, 0], [1, 1], [0, 0]], dtype=torch.float64).numpy()
    out = sample(logits, SamplingBatch.from_rules(rules, [None, None], 0, adjust=adjust))
    res = out.to_host()
    assert res.token_ids == [1, 0]
    assert res.logprobs == pytest.approx(logits.log_softmax(-1)[[0, 1], [1, 0]].tolist())


def test_held_back_tokens_get_no_probability_in_their_row_only() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(), SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    held: list[frozenset[int]] = [frozenset(), frozenset({2, 7}), frozenset({7})]
    adjust = LogitAdjustments.build(params, [[1]] * 3, [[3]] * 3, VOCAB, held_back=held)
    assert adjust is not None
    got = adjust.apply(logits)
    assert torch.equal(got[0], logits[0])
    assert torch.isinf(got[1, [2, 7]]).all() and (got[1] == -torch.inf).sum() == 2
    assert got[2, 7] == -torch.inf and got[2, 3] == logits[2, 3] - 1.0


def test_defaults_adjust_nothing_and_bad_values_are_refused() -> None:
    assert not adjusts_logits(SamplingParams())
    assert LogitAdjustments.build([SamplingParams()], [[1]], [[2]], VOCAB) is None
    assert adjusts_logits(SamplingParams(repetition_penalty=1.1))
    assert SamplingParams(logit_bias={"7": 1, "3": -2}).logit_bias == ((3, -2.0), (7, 1.0))
    for bad in (
        dict(logit_bias={"x": 1}),
        dict(logit_bias={"1": 101}),
        dict(logit_bias={"-1": 1}),
        dict(repetition_penalty=0),
        dict(frequency_penalty=2.5),
        dict(presence_penalty=-3),
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
