"""LoRA on a mixture-of-experts model: adapters on the attention projections give HF PEFT's greedy
tokens; an adapter on a sparse layer's experts is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import hf_greedy_batch
from tests.lora_adapters import make_lora_adapter, peft_model
from tests.unit.test_moe import GREEDY, NEW_TOKENS, PROMPTS, SMALL, moe_checkpoint
from workers import LLM, LoRARequest

CASE = "qwen3-moe-renorm-dense-layer"  # layer 0 dense, layer 1 sparse


def test_attention_adapter_on_moe_equals_peft(tmp_path: Path, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    base = moe_checkpoint(tmp_path / "base", smollm2_dir, CASE)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = make_lora_adapter(base, tmp_path / "attn", rank=4, alpha=8, modules=modules, seed=3)
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [tok.encode(p) for p in PROMPTS]
    expected = hf_greedy_batch(peft_model(base, adapter), prompts, NEW_TOKENS)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4, **SMALL)
    lora = LoRARequest(lora_name="attn", lora_int_id=1, lora_path=str(adapter))
    outs = llm.generate(prompts, GREEDY, lora_request=lora)
    assert [o.token_ids for o in outs] == expected
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] != expected  # the adapter acted


def test_adapter_on_expert_layer_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    base = moe_checkpoint(tmp_path / "base", smollm2_dir, CASE)
    modules = ["gate_proj", "up_proj"]
    adapter = make_lora_adapter(base, tmp_path / "mlp", rank=4, alpha=8, modules=modules, seed=4)
    # PEFT puts this adapter on the sparse layer's experts (transformers' fused expert weights)
    keys = load_file(adapter / "adapter_model.safetensors")
    assert any(".mlp.experts." in k for k in keys)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4, **SMALL)
    lora = LoRARequest(lora_name="mlp", lora_int_id=1, lora_path=str(adapter))
    with pytest.raises(ValueError, match="LoRA on MoE experts is not supported"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)
