"""Qwen3-MoE and Qwen2-MoE GGUF files (llama.cpp's `qwen3moe` / `qwen2moe` tensor names and
metadata, float32, SmolLM2's vocabulary): pdserve, which dequantises them through transformers
into a HF directory, gives the greedy tokens that transformers gives reading the same file. The
experts are 32 rows wide and Qwen2-MoE's shared expert 48, not the config classes' defaults, so
the widths transformers' GGUF reader misses are exercised."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_random_moe_gguf
from tests.unit.test_moe import GREEDY, PROMPTS, SMALL, hf_reference
from workers import LLM
from workers.model.files import gguf_config_fixes, resolve_model

EXPERT_SIZE = 32
SHARED_SIZE = 48


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}-f32.gguf"
    return make_random_moe_gguf(out, arch=request.param, layers=2, experts=8, top_k=2,
                                expert_size=EXPERT_SIZE, shared_size=SHARED_SIZE)  # fmt: skip


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own model cache, not ~/.cache/pdserve."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    return tmp_path


def test_greedy_tokens_equal_hf_from_the_same_file(moe_gguf: Path, cache: Path) -> None:
    # transformers' own GGUF reader, given the config fields it misses (GGUF_CONFIG_FIXES)
    qwen2 = "qwen2moe" in moe_gguf.name
    missed = dict(moe_intermediate_size=EXPERT_SIZE)
    if qwen2:
        missed["shared_expert_intermediate_size"] = SHARED_SIZE
    prompts, expected = hf_reference(moe_gguf.parent, moe_gguf.name, **missed)
    llm = LLM(str(moe_gguf), **SMALL)
    cfg = llm.engine.runner.model_config
    experts = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert experts == (8, 2, EXPERT_SIZE)
    assert cfg.shared_expert_intermediate_size == (SHARED_SIZE if qwen2 else 0)
    assert cfg.qk_norm != qwen2 and cfg.attention_bias == qwen2
    if not qwen2:
        assert cfg.norm_topk_prob  # llama.cpp renormalises a Qwen3-MoE's top-k
    assert [llm.engine.tokenizer.encode(p) for p in PROMPTS] == prompts  # the file's vocabulary
    layers = llm.engine.runner.model.decoder_layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoeBlock"] * 2
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert resolve_model(str(moe_gguf)).is_relative_to(cache)  # converted once, into the cache


def metadata_only_gguf(path: Path, arch: str, expert_width: int | None) -> Path:
    """A GGUF file of `arch` with no tensors and no vocabulary: read in milliseconds."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch)
    w.add_vocab_size(256)
    if expert_width is not None:
        w.add_expert_feed_forward_length(expert_width)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_expert_width_is_read_from_the_file(tmp_path: Path) -> None:
    """The fix: a Qwen3-MoE or Qwen2-MoE file's `expert_feed_forward_length` is given to
    transformers as `moe_intermediate_size`; other architectures, or a file without the key,
    get nothing."""
    qwen3_moe = metadata_only_gguf(tmp_path / "a.gguf", "qwen3moe", 1536)
    assert gguf_config_fixes(qwen3_moe) == {"moe_intermediate_size": 1536}
    qwen2_moe = metadata_only_gguf(tmp_path / "d.gguf", "qwen2moe", 1408)
    assert gguf_config_fixes(qwen2_moe) == {"moe_intermediate_size": 1408}
    assert gguf_config_fixes(metadata_only_gguf(tmp_path / "b.gguf", "qwen3moe", None)) == {}
    assert gguf_config_fixes(metadata_only_gguf(tmp_path / "c.gguf", "llama", 1536)) == {}
