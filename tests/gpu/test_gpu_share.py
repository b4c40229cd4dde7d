"""Two engines on one GPU at half of it each (as two Serve replicas at `num_gpus_per_rank` 0.5):
both start, each KV pool sized within its half whichever started first, and both serve."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from workers import LLM, SamplingParams

pytestmark = pytest.mark.gpu

UTIL = 0.85
SHARE = 0.5
PROMPTS = [[(5 * i + 3 * j) % 3000 + 11 for j in range(9 + 17 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_two_engines_at_half_a_gpu_each_start_and_serve(smollm2_random: Path) -> None:
    free, total = torch.cuda.mem_get_info()
    if free < total * UTIL:
        pytest.skip(f"the GPU has {free / 2**30:.1f} GiB free, two halves need {UTIL:.0%}")
    options = dict(
        device="cuda", dtype="bfloat16", gpu_memory_utilization=UTIL, gpu_share=SHARE,
        max_num_seqs=8,
    )  # fmt: skip
    engines = [LLM(str(smollm2_random), **options) for _ in range(2)]
    try:
        _check_within_half(engines, total)
    finally:
        while engines:
            engines.pop().close()
        gc.collect()
        torch.cuda.empty_cache()  # the two pools are most of the GPU: give it back


def _check_within_half(engines: list[LLM], total: int) -> None:
    allowed = total * UTIL * SHARE
    for llm in engines:
        runner = llm.engine.runner
        used = runner.weight_bytes + runner.pool.nbytes
        assert used <= allowed
        assert used >= 0.9 * allowed  # its half, not what the first engine left of the GPU
    outputs = [[o.token_ids for o in llm.generate(PROMPTS, GREEDY)] for llm in engines]
    assert outputs[0] == outputs[1]
