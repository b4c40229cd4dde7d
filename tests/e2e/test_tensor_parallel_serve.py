"""A tensor-parallel replica inside real Ray Serve: the replica is rank 0 in bundle 0 of its
placement group, its rank actor takes bundle 1, and it serves the single rank's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve

from cluster.app import _deployment_options
from cluster.config import AppConfig
from tests.e2e.conftest import running
from workers import LLM, SamplingParams
from workers.protocol import GenerateRequest
from workers.serve.decode import DecodeWorker

pytestmark = pytest.mark.e2e

PROMPT = (1, 450, 7483, 310, 3444, 338)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_pages": 64, "page_size": 4}


@pytest.fixture(scope="module")
def other_groups(serve_url: str) -> set[str]:
    """The placement groups of the applications other modules left running."""
    return set(ray.util.placement_group_table())


@pytest.fixture(scope="module")
def decode(serve_url: str, tiny_llama: str, other_groups: set[str]) -> Iterator[Any]:
    cfg = AppConfig.model_validate(
        {
            "mode": "colocated",
            "engine": {"model": tiny_llama, **ENGINE},
            "decode": {"tensor_parallel_size": 2, "num_cpus_per_rank": 0.5},
        }
    )
    app = serve.deployment(DecodeWorker, **_deployment_options("decode", cfg.decode)).bind(
        cfg.decode.engine(cfg.engine).model_dump(), cfg.kv_transfer.model_dump()
    )
    with running("tp", app, route_prefix=None) as handle:
        yield handle


def test_a_tp_replica_serves_the_single_rank_tokens(
    decode: Any, tiny_llama: str, other_groups: set[str]
) -> None:
    req = GenerateRequest(request_id="tp-0", prompt_token_ids=PROMPT, params=PARAMS)
    tokens = []
    for chunk in decode.options(stream=True).generate.remote(req):
        assert chunk.error is None
        tokens += chunk.token_ids
    [want] = LLM(tiny_llama, **ENGINE).generate(list(PROMPT), PARAMS)
    assert tokens == want.token_ids
    created = [g for i, g in ray.util.placement_group_table().items()
               if g["state"] == "CREATED" and i not in other_groups]  # fmt: skip
    assert len(created) == 1 and len(created[0]["bundles"]) == 2  # the replica's own group
    stats = decode.stats.remote().result(timeout_s=30)
    assert stats.kv_pages_pinned == 0 and stats.generation_tokens == 16
