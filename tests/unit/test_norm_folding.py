"""Norm gains folded into the next weights (the GPU decode layers' form) keep HF's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy, make_random_checkpoint
from workers import LLM, SamplingParams


def checkpoint_with_uneven_norms(tmp_path: Path, tokenizer_dir: Path, arch: str) -> Path:
    """A random checkpoint whose RMSNorm gains are not all 1 (HF initialises them to 1, which
    would make folding them a no-op)."""
    import transformers

    ckpt = make_random_checkpoint(tmp_path, tokenizer_dir, arch)
    hf = getattr(transformers, arch).from_pretrained(ckpt)
    gen = torch.Generator().manual_seed(1)
    for name, param in hf.named_parameters():
        if name.endswith("norm.weight"):
            param.data.copy_(torch.rand(param.shape, generator=gen) * 1.5 + 0.25)
    hf.save_pretrained(ckpt, safe_serialization=True)
    return ckpt


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: qkv bias
def test_folded_norm_gains_keep_hfs_greedy_tokens(
    arch: str, tmp_path: Path, smollm2_dir: Path
) -> None:
    import transformers

    ckpt = checkpoint_with_uneven_norms(tmp_path, smollm2_dir, arch)
    hf = getattr(transformers, arch).from_pretrained(ckpt).eval()
    prompts = [[(11 * i + 7 * j) % 3000 + 9 for j in range(3 + 8 * i)] for i in range(4)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(ckpt), enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert not model.norms_folded  # folding is for the GPU's skinny GEMMs only
    layer = model.decoder_layers[0]
    gain = layer.input_layernorm.weight.detach().clone()
    qkv = layer.self_attn.qkv_proj.weight.detach().clone()
    model.fold_norm_gains()
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(gain))
    assert torch.allclose(layer.self_attn.qkv_proj.weight, qkv * gain)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
