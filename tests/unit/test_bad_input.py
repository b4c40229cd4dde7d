"""Bad input fails early with an exception that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from workers import LLM, SamplingParams
from workers.model.config import UnsupportedModelError
from workers.model.files import ModelNotFoundError, resolve_model


def test_unknown_model_path_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_a_dir_without_weights_loads_random_ones(tmp_path: Path, smollm2_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))
    # load_format="dummy" (benchmarks): config and tokenizer are enough, for the ingress too
    assert resolve_model(str(tmp_path), "dummy") == tmp_path
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    [out] = LLM(str(tmp_path), load_format="dummy", num_kv_pages=8).generate([[1, 2, 3]], params)
    assert len(out.token_ids) == 3


def test_unknown_hub_id_is_not_downloaded() -> None:
    with pytest.raises(ModelNotFoundError, match="not an embedded model"):
        LLM("someone/model-that-is-not-cached")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_a_config_without_a_needed_field_names_it(tmp_path: Path, smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    del config["hidden_size"], config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="lacks hidden_size, max_position_embeddings"):
        LLM(str(tmp_path))


def test_empty_prompt_is_rejected() -> None:
    llm = LLM()
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValidationError, match="empty"):
        llm.generate([[]])


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.5),
                                         ("top_p", 0.0), ("logprobs", 21), ("top_k", -2),
                                         ("stop_token_ids", (-1,)),
                                         ("truncate_prompt_tokens", 0),
                                         ("truncate_prompt_tokens", -2)])
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(ValidationError, match="page_sise"):
        LLM(page_sise=16)
