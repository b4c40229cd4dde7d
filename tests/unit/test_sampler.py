"""Sampling math: filters keep the right sets, draws follow the distribution, seeds reproduce."""

from __future__ import annotations

import numpy as np
import torch

from workers.sampling.sampler import SamplingBatch, apply_filters, race, sample


def batch(
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: list[int | None] | None = None,
    logprobs: int = -1,
) -> SamplingBatch:
    seeds = seeds or [None] * n
    rules = np.array([[temperature], [top_k], [top_p], [min_p]], dtype=np.float64).repeat(n, 1)
    return SamplingBatch.from_rules(
        rules,
        generators=[None if s is None else torch.Generator().manual_seed(s) for s in seeds],
        num_logprobs=logprobs,
    )


PROBS = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_likely() -> None:
    assert kept(apply_filters(LOGITS, batch(1, top_k=2))) == [0, 1]


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    assert kept(apply_filters(LOGITS, batch(1, top_p=0.7))) == [0, 1]
    assert kept(apply_filters(LOGITS, batch(1, top_p=0.71))) == [0, 1, 2]
    assert kept(apply_filters(LOGITS, batch(1, top_p=0.1))) == [0]


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    assert kept(apply_filters(LOGITS, batch(1, min_p=0.5))) == [0, 1]


def test_greedy_takes_argmax() -> None:
    assert sample(LOGITS, batch(1, temperature=0.0)).to_host().token_ids == [0]


def test_samples_follow_filtered_distribution() -> None:
    torch.manual_seed(0)
    n = 20000
    logits = LOGITS.expand(n, -1).contiguous()
    tokens = torch.tensor(sample(logits, batch(n, top_k=3)).to_host().token_ids)
    freq = torch.bincount(tokens, minlength=5).float() / n
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    assert torch.allclose(freq, expected, atol=0.015), freq


def test_temperature_sharpens_distribution() -> None:
    torch.manual_seed(0)
    n = 20000
    logits = LOGITS.expand(n, -1).contiguous()
    tokens = torch.tensor(sample(logits, batch(n, temperature=0.5)).to_host().token_ids)
    freq = torch.bincount(tokens, minlength=5).float() / n
    expected = PROBS[0] ** 2 / (PROBS[0] ** 2).sum()
    assert torch.allclose(freq, expected, atol=0.015), freq


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    a = sample(logits, batch(4, seeds=[7, None, None, 9])).to_host().token_ids
    b = sample(logits, batch(4, seeds=[7, None, None, 9])).to_host().token_ids
    assert (a[0], a[3]) == (b[0], b[3])
    c = sample(logits[[0]], batch(1, seeds=[7])).to_host().token_ids
    assert c[0] == a[0]


def test_logprobs_are_of_the_raw_distribution() -> None:
    res = sample(LOGITS, batch(1, temperature=0.0, logprobs=2)).to_host()
    assert res.logprobs is not None and res.top_ids is not None and res.top_logprobs is not None
    assert abs(res.logprobs[0] - float(PROBS[0, 0].log())) < 1e-5
    assert res.top_ids[0] == [0, 1]


def test_a_zero_noise_draw_never_picks_a_token_of_probability_zero() -> None:
    # Exponential draws can be exactly 0; 0 / 0 would be NaN, which an argmax takes as the max.
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0]])
    noise = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0]])
    assert race(probs, noise).tolist() == [1, 2]
    noise[0, 3] = 0.0  # a zero draw of a token that can be picked makes it win, as p / 0+ would
    assert race(probs, noise).tolist() == [3, 2]
