"""A Qwen3-MoE GGUF file (llama.cpp's `qwen3moe` tensor names and metadata, float32, SmolLM2's
vocabulary): pdserve, which dequantises it through transformers into a HF directory, gives the
greedy tokens that transformers gives reading the same file. The experts are 32 rows wide, not
Qwen3MoeConfig's default 768, so the expert width transformers' GGUF reader misses is exercised."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_random_qwen3_moe_gguf
from tests.unit.test_moe import GREEDY, PROMPTS, SMALL, hf_reference
from workers import LLM
from workers.model.files import gguf_config_fixes, resolve_model

EXPERT_SIZE = 32


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-moe-gguf") / "tiny-qwen3-moe-f32.gguf"
    return make_random_qwen3_moe_gguf(out, layers=2, experts=8, top_k=2, expert_size=EXPERT_SIZE)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own model cache, not ~/.cache/pdserve."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    return tmp_path


def test_greedy_tokens_equal_hf_from_the_same_file(moe_gguf: Path, cache: Path) -> None:
    # transformers' own GGUF reader, given the one config field it misses (GGUF_CONFIG_FIXES)
    prompts, expected = hf_reference(
        moe_gguf.parent, moe_gguf.name, moe_intermediate_size=EXPERT_SIZE
    )
    llm = LLM(str(moe_gguf), **SMALL)
    cfg = llm.engine.runner.model_config
    experts = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert experts == (8, 2, EXPERT_SIZE)
    assert cfg.qk_norm and cfg.norm_topk_prob  # llama.cpp renormalises a Qwen3-MoE's top-k
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
    """The fix: a Qwen3-MoE file's `expert_feed_forward_length` is given to transformers as
    `moe_intermediate_size`; other architectures, or a file without the key, get nothing."""
    qwen3_moe = metadata_only_gguf(tmp_path / "a.gguf", "qwen3moe", 1536)
    assert gguf_config_fixes(qwen3_moe) == {"moe_intermediate_size": 1536}
    assert gguf_config_fixes(metadata_only_gguf(tmp_path / "b.gguf", "qwen3moe", None)) == {}
    assert gguf_config_fixes(metadata_only_gguf(tmp_path / "c.gguf", "llama", 1536)) == {}
