"""Tensor parallelism on the CPU (gloo): N ranks give the single rank's tokens, and the ranks'
lives (start, abort, death, close) are the engine's business: a dead rank kills the engine.

Ranks 1..N-1 are Ray actors; float32 all-reduces sum in another order than one matmul, so
equality is up to rounding noise, which these greedy prompts do not reach.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch.distributed as dist

from tests.conftest import RAY_CPUS, WORKER_NODES, make_random_checkpoint
from tests.tolerance import dot_scale, reduction_atol
from tests.waiting import wait_until
from workers import LLM, SamplingParams
from workers.engine.tp_runner import TPDriverRunner
from workers.engine_stats import EngineDeadError
from workers.parallel.ranks import TPRankError
from workers.protocol import GenerateRequest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5,",
]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(  # logits for prompt rows too: every rank runs the LM head's all-gather
        max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=0.8, prompt_logprobs=1
    ),
    SamplingParams(max_tokens=1, temperature=0.0),
]
TINY = dict(num_kv_pages=64, page_size=4, max_num_batched_tokens=16)  # chunked prefill too


@pytest.fixture(scope="module")
def single_rank(tiny_llama: str) -> list:
    return LLM(tiny_llama, **TINY).generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def shared_tp2(ray_cluster, tiny_llama: str) -> Iterator[LLM]:
    """A TP-2 engine with overlap scheduling for the tests up to the close test, which closes
    it (a rank actor takes ~10 s to start on 2 cores; one process holds one TP group at a time,
    so the tests after it start their own)."""
    llm = LLM(tiny_llama, tensor_parallel_size=2, overlap_scheduling=True, **TINY)
    yield llm
    llm.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_give_the_single_rank_tokens(
    request: pytest.FixtureRequest, ray_cluster, tiny_llama: str, single_rank: list, overlap: bool
) -> None:
    if overlap:
        llm = request.getfixturevalue("shared_tp2")
    else:  # its own, closed before the shared engine starts (one TP group a process)
        llm = LLM(tiny_llama, tensor_parallel_size=2, overlap_scheduling=False, **TINY)
        request.addfinalizer(llm.close)
    assert llm.engine.overlap is overlap
    assert llm.engine.runner.tp.size == 2
    outs = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.stats()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single_rank]
    assert [len(o.token_ids) for o in outs] == [24, 16, 20, 1]
    assert stats.kv_pages_pinned == 0 and stats.num_running == 0
    got, want = outs[2].prompt_logprobs, single_rank[2].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) > 1
    assert [lp.logprob for lp in got[1:] if lp] == pytest.approx(
        [lp.logprob for lp in want[1:] if lp], abs=1e-4
    )


def test_abort_under_tensor_parallel_frees_pages(shared_tp2: LLM) -> None:
    llm = shared_tp2
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[2])
    for rid in ("a", "b"):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, params=params))
    for _ in range(6):
        engine.step()
    assert engine.stats().kv_pages_used > 0
    assert engine.abort("a") is not None
    while engine.has_work():
        engine.step()
    assert engine.stats().kv_pages_used == engine.stats().kv_pages_cached
    assert engine.kv.radix is not None
    engine.kv.radix.evict(engine.allocator.num_usable)
    assert engine.stats().kv_pages_used == 0


def test_close_stops_the_rank_actors(shared_tp2: LLM) -> None:
    llm = shared_tp2
    actors = list(llm.engine.runner._ranks.actors)
    llm.close()
    assert not dist.is_initialized()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].device_uuid.remote(), timeout=30)
    llm.close()  # idempotent


def test_three_ranks_of_smollm2_give_the_single_rank_tokens(ray_cluster) -> None:
    """SmolLM2 has 9 query heads and 3 KV heads: one KV head per rank."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM(num_kv_pages=32).generate(PROMPTS[:2], params)
    with LLM(tensor_parallel_size=3, num_kv_pages=32, overlap_scheduling=True) as llm:
        assert llm.engine.runner.kv_layout.num_kv_heads == 1
        got = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def rank_died(runner: TPDriverRunner) -> bool:
    try:
        runner.check_alive()
    except TPRankError:
        return True
    return False


def test_a_dead_rank_kills_the_engine_with_a_clear_error(ray_cluster, tiny_llama: str) -> None:
    with LLM(tiny_llama, tensor_parallel_size=2, **TINY) as llm:
        runner = llm.engine.runner
        runner.check_alive()
        ray.kill(runner._ranks.actors[0])
        wait_until(lambda: rank_died(runner), 30, what="check_alive to see the killed rank")
        with pytest.raises(TPRankError, match="TP rank 1 died"):
            runner.check_alive()  # Serve's health check sees it before any step
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="TPRankError: TP rank 1 died"):
            llm.generate(PROMPTS[0], PARAMS[0])  # the step fails: the whole group is dead
        assert not llm.engine.seqs and llm.engine.kv.num_pinned_pages == 0
        with pytest.raises(EngineDeadError, match="TP rank 1 died"):
            llm.generate(PROMPTS[1], PARAMS[0])  # refused at once, no hang
        assert llm.engine.stats().engine_deaths == {"TPRankError": 1}
        assert time.monotonic() - start < 30


def test_heads_not_divisible_by_tp_size_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible"):
        LLM(tensor_parallel_size=2)


def test_a_row_parallel_linear_defers_its_all_reduce_only_without_bias() -> None:
    """A layer's o_proj and down hand their partial sums to the next norm, which sums them over
    the group (and adds the bias nowhere): so a biased one must refuse to defer."""
    import torch

    from workers.model.layers import RowParallelLinear
    from workers.parallel.group import TPGroup

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=gen)
    plain = RowParallelLinear(8, 4, bias=False, tp=TPGroup())
    torch.nn.init.normal_(plain.weight, generator=gen)
    atol = reduction_atol(8, dot_scale(x, plain.weight.detach()))
    torch.testing.assert_close(plain(x, reduce=False), x @ plain.weight.T, atol=atol, rtol=0)
    biased = RowParallelLinear(8, 4, bias=True, tp=TPGroup())
    with pytest.raises(ValueError, match="cannot defer its all-reduce"):
        biased(x, reduce=False)


def test_more_ranks_than_the_cluster_holds_are_refused(
    ray_cluster, tmp_path: Path, smollm2_dir: Path
) -> None:
    ranks = 32  # heads and features divide by it: only the cluster's CPUs are short
    assert ranks - 1 > RAY_CPUS + sum(WORKER_NODES.values())
    wide = make_random_checkpoint(
        tmp_path, smollm2_dir, "LlamaForCausalLM", num_attention_heads=ranks,
        num_key_value_heads=ranks,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"tensor_parallel_size={ranks} needs"):
        LLM(str(wide), tensor_parallel_size=ranks, **TINY)
    assert not dist.is_initialized()


def test_a_colocated_tp_pool_gets_one_bundle_per_rank_on_one_node() -> None:
    from cluster.app import _deployment_options
    from cluster.config import AppConfig

    cfg = AppConfig.model_validate(
        {"mode": "colocated", "decode": {"tensor_parallel_size": 2, "num_gpus_per_rank": 1}}
    )
    assert cfg.decode.engine(cfg.engine).tensor_parallel_size == 2
    options = _deployment_options("decode", cfg.decode)
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}  # in bundle 0


def test_tp_is_set_per_pool_not_in_the_engine() -> None:
    from pydantic import ValidationError

    from cluster.config import AppConfig

    with pytest.raises(ValidationError, match="per pool"):
        AppConfig.model_validate({"engine": {"tensor_parallel_size": 2}})


@pytest.mark.parametrize(("prefill", "decode"), [(2, 2), (1, 2), (4, 2)])
def test_any_tp_on_either_side_of_the_kv_hand_off_is_accepted(prefill: int, decode: int) -> None:
    from cluster.config import AppConfig

    cfg = AppConfig.model_validate(
        {"prefill": {"tensor_parallel_size": prefill}, "decode": {"tensor_parallel_size": decode}}
    )
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (prefill, decode)
