"""A Mixture-of-experts model (a tiny random Qwen3-MoE: a dense and a sparse layer) in real Ray
Serve, disaggregated, over HTTP: the router is unaware of experts, the prefill pool hands the KV
off to the decode pool over NIXL, and the tokens are the offline engine's (which equal HF
transformers', tests/unit/test_moe.py); the next turn reuses the cached prefix; a structured
output constrains the sparse model's tokens; /metrics counts the tokens routed per expert. Then
a colocated application of the same model serves the offline tokens too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import DECODE_NODE, PREFILL_NODE
from tests.e2e.conftest import deployed
from tests.e2e.serve_metrics import pool_counter, sample_sum, settled_counters
from tests.unit.test_moe import moe_checkpoint
from tests.waiting import wait_until
from workers import LLM, SamplingParams

pytestmark = pytest.mark.e2e

PAGE = 4
ENGINE = {"num_kv_pages": 96, "page_size": PAGE}
TURN_1 = [1] + [300 + 7 * i for i in range(6 * PAGE - 1)]  # 6 whole pages


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> str:
    tmp = tmp_path_factory.mktemp("moe-serve")
    return str(moe_checkpoint(tmp, smollm2_dir, "qwen3-moe-renorm-dense-layer"))


@pytest.fixture(scope="module")
def base_url(serve_url: str, moe_model: str) -> Iterator[str]:
    rank = {"num_cpus_per_rank": 0.5}
    args = {
        "engine": {"model": moe_model, **ENGINE},
        "served_model_name": "moe",
        "mode": "disaggregated",
        "prefill": {"resources": {PREFILL_NODE: 1}, **rank},
        "decode": {"resources": {DECODE_NODE: 1}, **rank},
        "router": {"num_cpus": 0, "enable_prompt_tokens_details": True},
    }
    with deployed(serve_url, "moe", args) as base:
        yield base


def complete(base_url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_moe_serves_the_offline_tokens_through_a_kv_hand_off(base_url: str, moe_model: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(moe_model, **ENGINE)
    [want] = llm.generate([TURN_1], params)
    before = settled_counters(base_url, [("decode", "kv_pages_read")])
    got = complete(base_url, TURN_1, 12)
    assert got["choices"][0]["text"] == want.text
    after = settled_counters(base_url, [("decode", "kv_pages_read")])
    assert after["decode kv_pages_read"] - before["decode kv_pages_read"] == 6
    assert pool_counter(base_url, "kv_transfer_recomputed") == 0  # handed off, not redone
    # the next turn: its first 6 pages come from the prefix cache
    turn_2 = TURN_1 + [500 + i for i in range(2 * PAGE)]
    [want_2] = llm.generate([turn_2], params)
    reply = complete(base_url, turn_2, 12)
    assert reply["choices"][0]["text"] == want_2.text
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * PAGE


def test_structured_output_on_an_moe_model(base_url: str) -> None:
    choices = ["alpha", "beta", "gamma"]
    reply = complete(
        base_url, TURN_1[:9], 8, ignore_eos=False, structured_outputs={"choice": choices}
    )
    assert reply["choices"][0]["text"] in choices


def test_routed_tokens_per_expert_are_exported(base_url: str) -> None:
    complete(base_url, TURN_1[:5], 2)

    def counted() -> float:
        return sample_sum(base_url, "pdserve:moe_expert_tokens_total", role="prefill", layer="1")

    wait_until(lambda: counted() > 0, 30, interval_s=0.5, what="routed tokens on /metrics")
    assert sample_sum(base_url, "pdserve:moe_expert_tokens_total", layer="0") == 0  # dense


def test_colocated_mode_serves_the_offline_tokens(serve_url: str, moe_model: str) -> None:
    args = {
        "engine": {"model": moe_model, **ENGINE},
        "served_model_name": "moe",
        "mode": "colocated",
        "decode": {"num_cpus_per_rank": 0.5},
        "router": {"num_cpus": 0},
    }
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [want] = LLM(moe_model, **ENGINE).generate([TURN_1[:11]], params)
    with deployed(serve_url, "moe-colocated", args) as base:
        assert complete(base, TURN_1[:11], 8)["choices"][0]["text"] == want.text
