"""Tensor parallelism over two GPUs: NCCL all-reduces between the ranks' steps.

A random Llama with 8 query / 4 KV heads of 64 splits into two ranks of 4 / 2. float32 with the
torch backend must give the single GPU's greedy tokens; bf16 with FlashInfer, overlap scheduling
and CUDA graphs (each rank replays its own, the all-reduces captured inside) must pick, at every
position, one of HF float32's best tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.conftest import make_random_checkpoint
from tests.gpu.conftest import count_replays, hf_judge
from workers import LLM, SamplingParams
from workers.tp_ranks import STOP_TIMEOUT_S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = [[(11 * i + 5 * j) % 3000 + 7 for j in range(4 + 19 * i)] for i in range(5)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
LOGIT_SLACK = 0.15  # as in test_engine_gpu: bf16 noise on a random model's logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> str:
    out = tmp_path_factory.mktemp("llama-tp")
    shape = dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    return str(make_random_checkpoint(out, tokenizer_dir, "LlamaForCausalLM", **shape))


def test_two_gpus_float32_give_the_single_gpu_tokens(llama: str) -> None:
    fp32 = dict(device="cuda", dtype="float32", attention_backend="torch", kv_cache_memory_gb=1)
    want = LLM(llama, **fp32).generate(PROMPTS, GREEDY)
    with LLM(llama, tensor_parallel_size=2, **fp32) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_two_gpus_bf16_flashinfer_track_hf(llama: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(
        llama,
        tensor_parallel_size=2,
        device="cuda",
        dtype="bfloat16",
        kv_cache_memory_gb=1,
        overlap_scheduling=True,
    )
    try:
        runner = llm.engine.runner
        graphs = runner.graphs
        assert runner.tp.size == 2 and graphs is not None
        assert llm.engine.overlap  # unseen ids travel rank 0 -> rank 1 on the device
        replays = count_replays(graphs)
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        start = time.perf_counter()
        llm.close()
    # The ranks leave the NCCL group together, after freeing the graphs that captured its
    # collectives; otherwise the destroy waits forever, or rank 0 waits out the join's timeout.
    assert time.perf_counter() - start < STOP_TIMEOUT_S
    assert len(replays) >= GREEDY.max_tokens - 1, replays  # every decode step replays
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).to("cuda").eval()
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == GREEDY.max_tokens
        _, shortfall = hf_judge(hf, prompt, out.token_ids)
        assert float(shortfall.max()) < LOGIT_SLACK, f"token far from HF's best: {shortfall}"
