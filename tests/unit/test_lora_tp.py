"""LoRA under tensor parallelism on the CPU (gloo): two ranks, each holding its split of the
adapters (B by output rows for q/k/v and gate/up, A by input columns for o and down), give the
tokens of HF PEFT on the unsplit model, for a batch mixing the base model and two adapters; an
unload frees the adapter on every rank."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import hf_greedy_batch
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model
from workers import LLM, LoRARequest, SamplingParams
from workers.engine.tp_runner import RemoveLoRA

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]
NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_two_ranks_give_peft_tokens(ray_cluster, tiny_llama: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = Path(tiny_llama)
    adapters = [
        LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(
            make_lora_adapter(base, tmp_path / "a", 8, 16, ALL_MODULES, seed=1, b_std=0.5))),
        LoRARequest(lora_name="b", lora_int_id=2, lora_path=str(
            make_lora_adapter(base, tmp_path / "b", 4, 8, ["k_proj", "o_proj", "up_proj"],
                              seed=2, rslora=True, b_std=0.5))),
    ]  # fmt: skip
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = {None: hf_greedy_batch(AutoModelForCausalLM.from_pretrained(base).float().eval(),
                                  prompts, NEW_TOKENS)}  # fmt: skip
    for lora in adapters:
        refs[lora.lora_name] = hf_greedy_batch(
            peft_model(base, Path(lora.lora_path)), prompts, NEW_TOKENS
        )
    assert refs["a"] != refs[None] and refs["b"] != refs[None]
    loras = [None, *adapters] * len(prompts)
    batch = [p for p in prompts for _ in range(3)]
    with LLM(tiny_llama, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
             num_kv_pages=64, page_size=4) as llm:  # fmt: skip
        outs = llm.generate(batch, GREEDY, lora_request=loras)
        # an unload reaches rank 1 too: it no longer holds the adapter, and holds the other one
        assert llm.engine.remove_lora(adapters[0].lora_int_id)
        runner = llm.engine.runner
        assert runner.command(RemoveLoRA(adapters[0].lora_int_id)) == [False]
        assert runner.command(RemoveLoRA(adapters[1].lora_int_id)) == [True]
        again = llm.generate(batch[:1], GREEDY, lora_request=adapters[0])[0]
        assert again.token_ids == refs["a"][0]  # loaded again from its files on both ranks
    for i, (out, lora) in enumerate(zip(outs, loras)):
        name = None if lora is None else lora.lora_name
        assert out.token_ids == refs[name][i // 3], f"prompt {i // 3} under {name}"
