"""Bad input fails early with an exception that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from workers import LLM, SamplingParams
from workers.model.config import UnsupportedModelError
from workers.model.loader import ModelNotFoundError


def test_unknown_model_path_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_unknown_hub_id_is_not_downloaded() -> None:
    with pytest.raises(ModelNotFoundError, match="not an embedded model"):
        LLM("someone/model-that-is-not-cached")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_empty_prompt_is_rejected() -> None:
    llm = LLM()
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValidationError, match="empty"):
        llm.generate([[]])


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.5),
                                         ("top_p", 0.0), ("logprobs", 21), ("top_k", -2)])
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(ValidationError, match="page_sise"):
        LLM(page_sise=16)
