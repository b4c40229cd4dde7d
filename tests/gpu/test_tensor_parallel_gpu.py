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
from workers.parallel.group import TPGroup
from workers.parallel.ranks import STOP_TIMEOUT_S

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
        assert runner.tp.ipc is not None  # the steps' all-reduces go over CUDA IPC
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


def _ipc_rank(rank: int, address: str) -> None:
    """One rank of `test_ipc_all_reduce_equals_nccl_in_and_out_of_graphs`: its own GPU as
    `cuda:0`, as Ray gives it."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch.distributed as dist

    from workers.parallel.ipc_all_reduce import MAX_BYTES
    from workers.parallel.rendezvous import destroy_group, init_group

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tp = init_group(rank, 2, address, device, ipc_all_reduce=True)
    assert tp.ipc is not None, "the IPC all-reduce did not start"
    gen = torch.Generator(device).manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float32):
        for numel in (1, 1000, 4096, 10_007, MAX_BYTES // dtype.itemsize):
            x = torch.randn(numel, generator=gen, device=device).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            assert tp.ipc.takes(x)
            got = tp.all_reduce(x.clone())
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
            both = tp.all_gather_object(got.cpu())
            assert torch.equal(both[0], both[1])  # every rank holds the same sum
    assert not tp.ipc.takes(torch.zeros(MAX_BYTES, device=device))  # too big: NCCL
    _check_fused_norm(tp, gen, device)
    # Captured: 30 all-reduces a replay, their flags counting on across replays.
    x = torch.zeros(8, 4096, dtype=torch.bfloat16, device=device)
    tp.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for i in range(30):
            outs.append(tp.all_reduce(x[i % 8 : i % 8 + 1].clone() * (i + 1)))
    for _ in range(4):
        x.copy_(torch.randn(8, 4096, generator=gen, device=device))
        graph.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            want = x[i % 8 : i % 8 + 1] * (i + 1)
            dist.all_reduce(want)
            torch.testing.assert_close(out, want, rtol=2**-7, atol=0)
    del graph
    destroy_group()


def _check_fused_norm(tp: TPGroup, gen: torch.Generator, device: torch.device) -> None:
    """`all_reduce_add_rms_norm` against NCCL then `fused.add_rms_norm`, eagerly and captured
    between two GEMVs (all launched with PDL: it must wait for the first one's output)."""
    import torch.distributed as dist

    from workers.kernels import fused
    from workers.kernels.skinny_gemm import skinny_linear

    assert tp.ipc is not None
    norm = (torch.rand(4096, generator=gen, device=device) + 0.5).to(torch.bfloat16)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
        res = torch.randn(rows, 4096, generator=gen, device=device).to(torch.bfloat16)
        assert tp.ipc.takes_rows(x, res)
        want = x.clone()
        dist.all_reduce(want)
        want_out, want_total = fused.add_rms_norm(want, res, norm, 1e-5)
        out, total = tp.ipc.all_reduce_add_rms_norm(x, res, norm, 1e-5)
        torch.testing.assert_close(total, want_total, rtol=2**-7, atol=0)
        torch.testing.assert_close(out, want_out, rtol=2**-7, atol=2**-7)
    w1 = (torch.randn(4096, 4096, generator=gen, device=device) / 64).to(torch.bfloat16)
    w2 = (torch.randn(4096, 4096, generator=gen, device=device) / 64).to(torch.bfloat16)
    h = torch.randn(1, 4096, generator=gen, device=device).to(torch.bfloat16)
    res = torch.randn(1, 4096, generator=gen, device=device).to(torch.bfloat16)

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        assert tp.ipc is not None
        out, total = tp.ipc.all_reduce_add_rms_norm(skinny_linear(h, w1), res, norm, 1e-5)
        return skinny_linear(out, w2), total

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, total = chain()
    for _ in range(3):
        h.copy_(torch.randn(1, 4096, generator=gen, device=device))
        graph.replay()
        torch.cuda.synchronize()
        want = skinny_linear(h, w1)
        dist.all_reduce(want)
        want_out, want_total = fused.add_rms_norm(want, res, norm, 1e-5)
        torch.testing.assert_close(total, want_total, rtol=2**-7, atol=0)
        torch.testing.assert_close(y, skinny_linear(want_out, w2), rtol=2**-6, atol=2**-6)


def test_ipc_all_reduce_equals_nccl_in_and_out_of_graphs() -> None:
    """Two processes, each seeing one GPU: the CUDA-IPC one-shot all-reduce starts (its own
    start-up check passes), equals NCCL's sum for every size it takes and both dtypes, gives
    both ranks the same bits, and replays correctly in a CUDA graph call after call; its form
    with the residual add and RMSNorm equals NCCL followed by `fused.add_rms_norm`."""
    import torch.multiprocessing as mp

    from workers.parallel.rendezvous import free_port

    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    mp.spawn(_ipc_rank, args=(address,), nprocs=2, join=True)
