"""A step planned and queued behind a busy GPU keeps its own schedule when the next step is planned
before the GPU reaches it (overlap scheduling; `workers/attention/replan_gate.py`): FlashInfer's
plan copies its schedule from one pinned buffer per wrapper, which the next plan rewrote while
the copy still waited. Without the gate the first step attends with the second's schedule: wrong
output, or an illegal memory access."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_flashinfer_attention import HEADS, qkv, random_batch, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_queued_step_keeps_its_schedule_when_the_next_is_planned(kind: str) -> None:
    from workers.attention.flashinfer import FlashInferAttention

    hq, hkv, d = HEADS["gqa-32/8-d128"]
    pool, second = random_batch(kind, 16, hkv, d, seed=22)  # nine sequences: the larger pool
    _, first = random_batch(kind, 16, hkv, d, seed=21, pool=pool, kv_lens=[600, 9, 300, 1, 77])
    q1 = qkv(first.num_tokens, hq, hkv, d, seed=21)[0]
    q2 = qkv(second.num_tokens, hq, hkv, d, seed=22)[0]
    expected = []
    for batch, q in ((first, q1), (second, q2)):  # attention only: the pool stays as it is
        alone = FlashInferAttention(pool, hq, d**-0.5)
        alone.plan(batch)
        expected.append(alone.attend_rotated(0, q))
    torch.cuda.synchronize()
    attn = FlashInferAttention(pool, hq, d**-0.5)
    for _ in range(3):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time ahead of the first plan's copy
        attn.plan(first)
        out1 = attn.attend_rotated(0, q1)
        attn.plan(second)  # the host runs ahead: the first step's copy has not run yet
        out2 = attn.attend_rotated(0, q2)
        torch.cuda.synchronize()
        assert rel_err(out1, expected[0]) < 1e-3
        assert rel_err(out2, expected[1]) < 1e-3
