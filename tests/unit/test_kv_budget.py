"""An engine's KV pool follows its share of the GPU, and a pool too small fails saying why.

Figures of Llama-3-8B in bf16 on an H200: 15 GiB of weights, 2 MiB pages of 16 tokens, 513
pages for one 8192-token sequence (and the scratch page).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.app import build_app
from cluster.config import AppConfig
from workers.engine.kv_budget import GiB, GPUMemory, KVBudgetError, fixed_kv_pages, gpu_kv_pages

H200 = int(139.8 * GiB)
WEIGHTS = 15 * GiB
CONTEXT = GiB // 2  # a process's CUDA context, outside torch's allocator
PAGE = 2 * 2**20
MIN_PAGES = 513
UTIL = 0.85
FIXES = ("gpu_memory_utilization", "num_gpus_per_rank", "max_model_len", "num_kv_pages")


def test_the_whole_gpu_keeps_the_budget_free_memory_gave() -> None:
    free = H200 - CONTEXT - WEIGHTS
    pages = gpu_kv_pages(GPUMemory(H200, free, WEIGHTS), UTIL, 1.0, PAGE, MIN_PAGES)
    assert pages == int(free - H200 * (1 - UTIL)) // PAGE


@pytest.mark.parametrize("first_started", [True, False])
def test_a_replica_at_half_a_gpu_gets_half_whoever_started_first(first_started: bool) -> None:
    """On one H200 the second replica sized its pool from the free memory, after the first took
    85% of the GPU (a budget of -17 GiB); by its share each gets its half, in either order."""
    other = int(H200 * UTIL * 0.5) if first_started else WEIGHTS  # weights + pool, or weights
    free = H200 - other - 2 * CONTEXT - WEIGHTS
    pages = gpu_kv_pages(GPUMemory(H200, free, WEIGHTS), UTIL, 0.5, PAGE, MIN_PAGES)
    assert pages == int(H200 * UTIL * 0.5 - WEIGHTS) // PAGE
    assert WEIGHTS + pages * PAGE <= H200 * UTIL * 0.5


def test_memory_something_else_took_caps_the_pool() -> None:
    free = H200 - 100 * GiB - CONTEXT - WEIGHTS
    pages = gpu_kv_pages(GPUMemory(H200, free, WEIGHTS), UTIL, 0.5, PAGE, MIN_PAGES)
    assert pages == int(free - H200 * (1 - UTIL) * 0.5) // PAGE


def _error(mem: GPUMemory, share: float) -> str:
    with pytest.raises(KVBudgetError) as err:
        gpu_kv_pages(mem, UTIL, share, PAGE, MIN_PAGES)
    message = str(err.value)
    assert all(fix in message for fix in FIXES), message
    assert not re.search(r"-\d", message), message  # no negative budget
    return message


def test_weights_beyond_the_share_fail_saying_what_to_change() -> None:
    message = _error(GPUMemory(H200, H200 - 2 * WEIGHTS, 2 * WEIGHTS), share=0.25)
    assert "weights and buffers hold 30.00 GiB" in message
    assert "leaving 0.00 GiB, 0 pages" in message
    assert "x gpu_share 0.25 of the GPU's 139.80 GiB" in message


def test_a_pool_short_of_one_sequence_fails() -> None:
    held = int(H200 * UTIL * 0.2) - 100 * PAGE  # room for 100 pages
    message = _error(GPUMemory(H200, H200 - held, held), share=0.2)
    assert "100 pages; one sequence of max_model_len tokens needs 513 pages of 2.00 MiB" in message


def test_a_gpu_that_others_filled_fails_naming_its_free_memory() -> None:
    message = _error(GPUMemory(H200, 10 * GiB, WEIGHTS), share=0.5)
    assert "the GPU has 10.00 GiB free" in message


def test_a_set_budget_under_two_pages_fails_naming_the_field() -> None:
    assert fixed_kv_pages(GiB, PAGE) == 512
    with pytest.raises(KVBudgetError, match="raise kv_cache_memory_gb or set num_kv_pages"):
        fixed_kv_pages(PAGE, PAGE)


def test_the_runner_refuses_an_absurd_kv_memory_on_cpu(tiny_llama: str) -> None:
    from workers.config import EngineConfig
    from workers.engine.model_runner import ModelRunner

    with pytest.raises(KVBudgetError, match="raise kv_cache_memory_gb"):
        ModelRunner(EngineConfig(model=tiny_llama, device="cpu", kv_cache_memory_gb=1e-9))


def _engines(args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each pool's engine config as the built (not run) application binds it."""
    router = build_app(args)._bound_deployment
    pools = {}
    for bound in router.init_args[1:]:
        if bound is not None:
            deployment = bound._bound_deployment
            pools[deployment.name] = deployment.init_args[0]
    return pools


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pools_gpu_fraction_becomes_its_engines_share(tp: int) -> None:
    engines = _engines(
        {
            "engine": {"device": "cuda"},
            "prefill": {"num_gpus_per_rank": 0.5, "tensor_parallel_size": tp},
            "decode": {"num_gpus_per_rank": 1, "tensor_parallel_size": tp},
        }
    )
    assert engines["prefill"]["gpu_share"] == 0.5
    assert engines["decode"]["gpu_share"] == 1.0


def test_pools_without_gpus_and_colocated_ones_get_their_share() -> None:
    assert {k: e["gpu_share"] for k, e in _engines({}).items()} == {"prefill": 1, "decode": 1}
    colocated = _engines({"mode": "colocated", "decode": {"num_gpus_per_rank": 0.25}})
    assert {k: e["gpu_share"] for k, e in colocated.items()} == {"decode": 0.25}


def test_a_share_set_for_every_pool_is_refused_naming_the_pool_field() -> None:
    with pytest.raises(ValidationError, match="num_gpus_per_rank"):
        AppConfig.model_validate({"engine": {"gpu_share": 0.5}})
