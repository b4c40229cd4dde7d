"""A tensor-parallel replica inside real Ray Serve: the replica is rank 0 in bundle 0 of its
placement group, its rank actor takes bundle 1, and it serves the single rank's tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve

from cluster.app import _deployment_options
from cluster.config import AppConfig
from tests.conftest import make_random_checkpoint
from workers import LLM, SamplingParams
from workers.protocol import GenerateRequest
from workers.serve.decode import DecodeWorker

pytestmark = pytest.mark.e2e

REPO = str(Path(__file__).resolve().parents[2])
PROMPT = (1, 450, 7483, 310, 3444, 338)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_pages": 64, "page_size": 4}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> str:
    tmp = tmp_path_factory.mktemp("tiny-llama")
    return str(make_random_checkpoint(tmp, smollm2_dir, "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def decode(tiny_llama: str) -> Iterator[Any]:
    path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
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
    try:
        yield serve.run(app, name="tp", route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_tp_replica_serves_the_single_rank_tokens(decode: Any, tiny_llama: str) -> None:
    req = GenerateRequest(request_id="tp-0", prompt_token_ids=PROMPT, params=PARAMS)
    tokens = []
    for chunk in decode.options(stream=True).generate.remote(req):
        assert chunk.error is None
        tokens += chunk.token_ids
    [want] = LLM(tiny_llama, **ENGINE).generate(list(PROMPT), PARAMS)
    assert tokens == want.token_ids
    created = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(created) == 1 and len(created[0]["bundles"]) == 2  # the replica's own group
    stats = decode.stats.remote().result(timeout_s=30)
    assert stats.kv_pages_pinned == 0 and stats.generation_tokens == 16
