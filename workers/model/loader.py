"""Weights: a checkpoint's safetensors streamed into the model, built on its device and dtype
(the files themselves: `files.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from workers.model.config import ModelConfig
from workers.model.files import ModelNotFoundError
from workers.model.llama import LlamaForCausalLM
from workers.parallel.group import TPGroup


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            for key in tqdm(keys, desc=f"loading {path.name}", leave=False, disable=None):
                yield key, f.get_tensor(key)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup,
    fold_norms: bool = True,
) -> LlamaForCausalLM:
    """Build the module directly on `device` in `dtype`, then fill this rank's weight shards
    (`fold_norms`: `LlamaForCausalLM`'s)."""
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg, tp, fold_norms)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
