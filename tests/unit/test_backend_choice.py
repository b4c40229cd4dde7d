"""Which attention backend `auto` picks: FlashInfer only where its kernels exist for the model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from workers.config import FLASHINFER_HEAD_DIMS, EngineConfig

CUDA = torch.device("cuda")


@pytest.fixture
def flashinfer_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU machine: the choice looks only for the package, not into it."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: object() if name == "flashinfer" else find_spec(name, *a),
    )  # fmt: skip


@pytest.mark.usefixtures("flashinfer_installed")
@pytest.mark.parametrize("head_dim", FLASHINFER_HEAD_DIMS)
def test_auto_takes_flashinfer_for_its_head_sizes(head_dim: int) -> None:
    assert EngineConfig().resolved_backend(CUDA, torch.bfloat16, head_dim) == "flashinfer"


@pytest.mark.usefixtures("flashinfer_installed")
@pytest.mark.parametrize("head_dim", [16, 32, 80, 96])
def test_auto_takes_torch_for_head_sizes_flashinfer_lacks(head_dim: int) -> None:
    assert EngineConfig().resolved_backend(CUDA, torch.bfloat16, head_dim) == "torch"
    assert EngineConfig().resolved_backend(torch.device("cpu"), torch.bfloat16, 64) == "torch"
