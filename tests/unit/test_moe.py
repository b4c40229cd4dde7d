"""Mixture-of-experts models: the engine's greedy tokens equal HF transformers' on tiny random
Qwen3-MoE, Qwen2-MoE (a gated shared expert beside the routed ones) and Mixtral checkpoints
(float32), sparse and dense layers mixed; the loader takes the families' expert names and
refuses a checkpoint missing an expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy_batch, make_random_checkpoint
from workers import LLM, SamplingParams
from workers.model.config import ModelConfig
from workers.model.moe_experts import grouped_experts

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5,",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SMALL = dict(num_kv_pages=96, page_size=4, max_num_batched_tokens=16)  # chunked prefill too
# hidden 64 (tiny-llama's), experts of 32 rows, top-2
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
CASES = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", QWEN3_MOE),
    "qwen3-moe-renorm-dense-layer": (  # layer 0 dense (mlp_only_layers), renormalised top-k
        "Qwen3MoeForCausalLM",
        dict(QWEN3_MOE, norm_topk_prob=True, mlp_only_layers=[0]),
    ),
    "qwen3-moe-sparse-step-2": (  # layer 0 dense, layer 1 sparse
        "Qwen3MoeForCausalLM",
        dict(QWEN3_MOE, decoder_sparse_step=2, num_experts=4),
    ),
    "mixtral": ("MixtralForCausalLM", MIXTRAL),
    "qwen2-moe-shared-expert": (  # layer 0 dense; q/k/v biases, no q/k norms
        "Qwen2MoeForCausalLM",
        dict(QWEN3_MOE, shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    ),
}


def moe_checkpoint(tmp: Path, tokenizer_dir: Path, case: str) -> Path:
    arch, fields = CASES[case]
    return make_random_checkpoint(tmp, tokenizer_dir, arch, **fields)


def hf_reference(
    path: Path, gguf_file: str | None = None, **config: object
) -> tuple[list[list[int]], list[list[int]]]:
    """PROMPTS' token ids and HF transformers' greedy tokens for them (float32), from the
    checkpoint directory `path` or its file `gguf_file`; `config` overrides config fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    prompts = [tok.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(
        path, gguf_file=gguf_file, torch_dtype=torch.float32, **config
    ).eval()
    return prompts, hf_greedy_batch(hf, prompts, NEW_TOKENS)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_hf(tmp_path: Path, smollm2_dir: Path, case: str) -> None:
    path = moe_checkpoint(tmp_path, smollm2_dir, case)
    prompts, expected = hf_reference(path)
    llm = LLM(str(path), enable_prefix_caching=True, **SMALL)
    cfg = llm.engine.runner.model_config
    layers = llm.engine.runner.model.decoder_layers
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers]
    assert sparse == [cfg.is_sparse_layer(i) for i in range(cfg.num_layers)]
    assert any(sparse)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    # again: the prompts' pages now come from the prefix cache
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_config_reads_each_family() -> None:
    base = dict(vocab_size=8, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
                max_position_embeddings=64)  # fmt: skip
    mix = ModelConfig.from_hf(dict(base, architectures=["MixtralForCausalLM"],
                                   intermediate_size=16, num_local_experts=4))  # fmt: skip
    assert (mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size) == (4, 2, 16)
    assert mix.norm_topk_prob and all(mix.is_sparse_layer(i) for i in range(4))
    qwen = ModelConfig.from_hf(dict(
        base, architectures=["Qwen3MoeForCausalLM"], intermediate_size=16, num_experts=8,
        moe_intermediate_size=4, decoder_sparse_step=2, mlp_only_layers=[3],
    ))  # fmt: skip
    assert qwen.qk_norm and not qwen.norm_topk_prob and qwen.sliding_window is None
    assert [qwen.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    assert qwen.shared_expert_intermediate_size == 0
    # Qwen2MoeConfig's defaults for what the config.json leaves out
    qwen2 = ModelConfig.from_hf(dict(base, architectures=["Qwen2MoeForCausalLM"],
                                     intermediate_size=16))  # fmt: skip
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.moe_intermediate_size) == (
        60, 4, 1408)  # fmt: skip
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.attention_bias
    assert not qwen2.qk_norm and qwen2.sliding_window is None
    no_bias = ModelConfig.from_hf(dict(base, architectures=["Qwen2MoeForCausalLM"],
                                       intermediate_size=16, qkv_bias=False))  # fmt: skip
    assert not no_bias.attention_bias


def test_shared_expert_block_equals_hf(tmp_path: Path, smollm2_dir: Path) -> None:
    """Qwen2-MoE's sparse block (routed experts plus the shared expert times the sigmoid of its
    gate) on random rows against HF transformers' block with the same weights (float32); the
    shared expert's share of the output is not small (so the equality tests it)."""
    from transformers import AutoModelForCausalLM

    path = moe_checkpoint(tmp_path, smollm2_dir, "qwen2-moe-shared-expert")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    block = LLM(str(path), **SMALL).engine.runner.model.decoder_layers[1].mlp
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf.model.layers[1].mlp(x[None])[0]
        got = block(x)
        routed = block.experts(x, *block.gate(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float((got - routed).norm()) > 0.1 * float(got.norm())


def test_missing_expert_weight_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    path = moe_checkpoint(tmp_path, smollm2_dir, "mixtral")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks model\.layers\.1\.mlp\.experts: expert 2 up"):
        LLM(str(path), **SMALL)


def test_grouped_experts_equal_a_dense_loop() -> None:
    """The torch path against every (token, slot) pair computed on its own, experts of a range
    [first, first + 3) only (an expert-parallel rank's)."""
    gen = torch.Generator().manual_seed(0)
    T, H, inter, E, k, first = 9, 16, 8, 6, 2, 2
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if first <= e < first + 3:
                gate, up = (w13[e] @ x[t]).chunk(2)
                want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    got = grouped_experts(x, w13[first : first + 3], w2[first : first + 3], weights, ids, first)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[(ids < first).all(1) | (ids >= first + 3).all(1)] == 0).all()


def test_routed_tokens_are_counted_and_exported(tmp_path: Path, smollm2_dir: Path) -> None:
    """Each sparse layer counts top-k experts per computed token; /metrics renders them per
    role, layer and expert, replicas summed."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.backend import RoleStats
    from router.metrics import Metrics

    path = moe_checkpoint(tmp_path, smollm2_dir, "qwen3-moe-sparse-step-2")  # layer 1 sparse
    llm = LLM(str(path), enable_prefix_caching=False, **SMALL)
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.stats()
    assert list(stats.moe_expert_tokens) == ["1"]
    per_expert = stats.moe_expert_tokens["1"]
    # every prompt token and every generated token but the last was computed, k experts each
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    assert len(per_expert) == 4 and sum(per_expert) == 2 * tokens
    assert sum(n > 0 for n in per_expert) >= 2
    text = Metrics("m").render([RoleStats("decode", stats), RoleStats("decode", stats)])
    got = {
        (s.labels["layer"], s.labels["expert"]): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "pdserve:moe_expert_tokens_total" and s.labels["role"] == "decode"
    }
    assert got == {("1", str(e)): 2 * n for e, n in enumerate(per_expert)}


def test_speculative_decoding_and_fp8_kv_on_moe(tmp_path: Path, smollm2_dir: Path) -> None:
    """ngram drafts verified by the MoE target give its own greedy tokens (verify steps route
    several rows a sequence); an FP8 KV cache serves the model (its tokens may differ)."""
    path = moe_checkpoint(tmp_path, smollm2_dir, "mixtral")
    plain = [o.token_ids for o in LLM(str(path), **SMALL).generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(path), speculative=spec, **SMALL)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert llm.engine.stats().spec_num_draft_tokens > 0
    fp8 = LLM(str(path), kv_cache_dtype="fp8_e4m3", **SMALL).generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in fp8] == [NEW_TOKENS] * len(PROMPTS)
    agree = sum(a == b for o, p in zip(fp8, plain) for a, b in zip(o.token_ids, p))
    assert agree >= len(PROMPTS)  # at least the first tokens, before any near tie cascades


def test_transformers_stacked_expert_tensors_load(tmp_path: Path, smollm2_dir: Path) -> None:
    """A checkpoint of transformers 5's in-memory tensors (as a GGUF file dequantised through it
    is saved: `mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) gives the tokens of
    the per-expert checkpoint."""
    from transformers import AutoModelForCausalLM

    path = moe_checkpoint(tmp_path / "per-expert", smollm2_dir, "mixtral")
    want = [o.token_ids for o in LLM(str(path), **SMALL).generate(PROMPTS[:2], GREEDY)]
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    got = [o.token_ids for o in LLM(str(stacked), **SMALL).generate(PROMPTS[:2], GREEDY)]
    assert got == want
