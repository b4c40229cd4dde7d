"""LoRA on a GPU (SmolLM2, real weights): in float32 the mixed batch's greedy tokens equal HF
PEFT's on the GPU; in bf16, where the norm gains are folded into the weights at load, a LoRA step
(unfolded, the gains folded into A too) gives the tokens the unfolded model gives; a LoRA decode
step replays its size's LoRA CUDA graph and gives the eager LoRA path's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hf_greedy_batch
from tests.gpu.conftest import record_replays
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model
from workers import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[LoRARequest]:
    tmp = tmp_path_factory.mktemp("gpu-loras")
    a = make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1)
    b = make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=2,
                          rslora=True)  # fmt: skip
    return [
        LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(a)),
        LoRARequest(lora_name="b", lora_int_id=2, lora_path=str(b)),
    ]


def _batch(llm: LLM, adapters: list[LoRARequest]) -> tuple[list[list[int]], list]:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    loras = [None, *adapters] * len(prompts)
    return [p for p in prompts for _ in range(3)], loras


def test_float32_mixed_batch_equals_peft(adapters, smollm2_dir: Path) -> None:
    llm = LLM(device="cuda", dtype="float32", attention_backend="torch", enable_lora=True,
              max_loras=2, max_lora_rank=8)  # fmt: skip
    batch, loras = _batch(llm, adapters)
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    prompts = batch[::3]
    refs = {}
    for lora in [None, *adapters]:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(smollm2_dir)
            if lora is None
            else peft_model(smollm2_dir, Path(lora.lora_path))
        )
        refs[None if lora is None else lora.lora_name] = hf_greedy_batch(
            model.float().cuda().eval(), prompts, NEW_TOKENS
        )
    for i, (out, lora) in enumerate(zip(outs, loras)):
        name = None if lora is None else lora.lora_name
        assert out.token_ids == refs[name][i // 3], f"prompt {i // 3} under {name}"


def test_bf16_lora_steps_see_the_folded_gains(adapters) -> None:
    folded = LLM(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8)
    if not folded.engine.runner.model.norms_folded:
        pytest.skip("this GPU's skinny GEMM does not take SmolLM2's decode: nothing is folded")
    plain = LLM(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8,
                kernels={"fold_norms": False})  # fmt: skip
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    batch, loras = _batch(folded, adapters)
    got = [o.token_ids for o in folded.generate(batch, few, lora_request=loras)]
    want = [o.token_ids for o in plain.generate(batch, few, lora_request=loras)]
    assert got == want
    base = [o.token_ids for o in folded.generate(batch, few)]
    assert [g for g, lora in zip(got, loras) if lora] != [b for b, lora in zip(base, loras) if lora]


def test_lora_decode_steps_replay_a_graph_with_the_eager_tokens(
    adapters, smollm2_dir: Path
) -> None:
    """The mixed batch's decode steps (9 rows, padded to 16: the padding rows base rows) replay
    the LoRA graph with the step's slot mask, and give the eager LoRA path's greedy tokens; a
    batch of base requests only replays the base graph."""
    kw = dict(device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory_gb=1)
    graphed = LLM(str(smollm2_dir), cuda_graph_batch_sizes=(16,), **kw)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.has_lora
    replays: list[tuple[int, bool]] = []  # (rows, with a slot mask)
    record_replays(
        graphs, lambda batch, mask: replays.append((len(batch.q_lens), mask is not None))
    )
    batch, loras = _batch(graphed, adapters)
    got = [o.token_ids for o in graphed.generate(batch, GREEDY, lora_request=loras)]
    assert replays == [(16, True)] * (NEW_TOKENS - 1)  # the prompts' step runs eagerly
    replays.clear()
    graphed.generate(batch, GREEDY)
    assert set(replays) == {(16, False)}  # cached prompts may replay from their first step
    del graphed
    eager = LLM(str(smollm2_dir), enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    want = [o.token_ids for o in eager.generate(batch, GREEDY, lora_request=loras)]
    assert got == want
