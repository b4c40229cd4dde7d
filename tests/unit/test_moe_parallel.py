"""MoE models over two ranks on the CPU (gloo): tensor parallel (each expert split as a dense
MLP) and expert parallel (whole experts per rank) give the single rank's greedy tokens; an
expert count the ranks cannot split is refused before any rank starts.

Ranks 1..N-1 are Ray actors (run under the e2e lock); float32 all-reduces sum in another order
than one rank's GEMMs, so equality is up to rounding noise these greedy prompts do not reach.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_random_checkpoint
from tests.unit.test_moe import GREEDY, MIXTRAL, PROMPTS, SMALL, moe_checkpoint
from workers import LLM


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> str:
    # layer 0 dense, so one TP engine runs both MLP kinds
    tmp = tmp_path_factory.mktemp("qwen3-moe")
    return str(moe_checkpoint(tmp, smollm2_dir, "qwen3-moe-renorm-dense-layer"))


@pytest.fixture(scope="module")
def single_rank(qwen3_moe: str) -> list[list[int]]:
    return [o.token_ids for o in LLM(qwen3_moe, **SMALL).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_the_single_rank_tokens(
    ray_cluster, qwen3_moe: str, single_rank: list[list[int]], expert_parallel: bool
) -> None:
    llm = LLM(qwen3_moe, tensor_parallel_size=2, expert_parallel=expert_parallel, **SMALL)
    try:
        experts = llm.engine.runner.model.decoder_layers[1].mlp.experts
        # rank 0 holds half the experts whole, or every expert's half
        assert experts.w13.shape[0] == (4 if expert_parallel else 8)
        assert experts.w13.shape[1] == (64 if expert_parallel else 32)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == single_rank
    finally:
        llm.close()


def test_uneven_expert_split_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    path = make_random_checkpoint(
        tmp_path, smollm2_dir, "MixtralForCausalLM", **dict(MIXTRAL, num_local_experts=3)
    )
    with pytest.raises(ValueError, match=r"num_experts \(expert_parallel\)=3 is not divisible"):
        LLM(str(path), tensor_parallel_size=2, expert_parallel=True, **SMALL)
