"""MoE models over two ranks on the CPU (gloo): tensor parallel (each expert split as a dense
MLP) and expert parallel (whole experts per rank) give the single rank's greedy tokens, with
and without Qwen2-MoE's shared expert (split as a dense MLP under both); an expert count the
ranks cannot split is refused before any rank starts.

Ranks 1..N-1 are Ray actors (run under the e2e lock); float32 all-reduces sum in another order
than one rank's GEMMs, so equality is up to rounding noise these greedy prompts do not reach.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_random_checkpoint
from tests.unit.test_moe import GREEDY, MIXTRAL, PROMPTS, SMALL, moe_checkpoint
from workers import LLM


# layer 0 dense in both, so one TP engine runs both MLP kinds
@pytest.fixture(scope="module", params=["qwen3-moe-renorm-dense-layer", "qwen2-moe-shared-expert"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              smollm2_dir: Path) -> str:  # fmt: skip
    tmp = tmp_path_factory.mktemp(request.param)
    return str(moe_checkpoint(tmp, smollm2_dir, request.param))


@pytest.fixture(scope="module")
def single_rank(moe_model: str) -> list[list[int]]:
    return [o.token_ids for o in LLM(moe_model, **SMALL).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_the_single_rank_tokens(
    ray_cluster, moe_model: str, single_rank: list[list[int]], expert_parallel: bool
) -> None:
    llm = LLM(moe_model, tensor_parallel_size=2, expert_parallel=expert_parallel, **SMALL)
    try:
        block = llm.engine.runner.model.decoder_layers[1].mlp
        experts = block.experts
        # rank 0 holds half the experts whole, or every expert's half
        assert experts.w13.shape[0] == (4 if expert_parallel else 8)
        assert experts.w13.shape[1] == (64 if expert_parallel else 32)
        if block.shared_expert is not None:  # half of its 48 gate and 48 up rows either way
            assert block.shared_expert.gate_up_proj.weight.shape[0] == 48
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
