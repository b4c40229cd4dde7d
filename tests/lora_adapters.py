"""Random PEFT LoRA adapters of a base checkpoint, saved as PEFT saves them (for the LoRA tests).

B is random too (PEFT starts it at zero), large enough that greedy tokens differ from the base
model's and small enough that they stay text."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(
    base_dir: Path, out_dir: Path, rank: int, alpha: float, modules: list[str], seed: int,
    rslora: bool = False, b_std: float = 0.05,
) -> Path:  # fmt: skip
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path):  # noqa: ANN201 - a PEFT model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
