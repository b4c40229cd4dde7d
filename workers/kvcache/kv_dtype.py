"""The KV cache's storage dtype and its FP8 scales (`EngineConfig.kv_cache_dtype`).

`auto` stores K and V in the model's dtype. `fp8_e4m3` stores `x / scale` in float8_e4m3fn, one
byte an element, and attention reads `stored * scale`. Scales are static and per tensor: one
for K and one for V per layer, taken from the checkpoint where it has them (`k_scale` /
`v_scale` tensors, vLLM's convention) and 1.0 otherwise. Per tensor, because the hand-off then
moves pages as they are: every TP rank, prefill or decode, any split of the heads, reads the
same scale. Static, because a page's bytes must mean the same thing in every replica that reads
them. What 1.0 costs in accuracy: docs/fp8_kv_cache.md. `int8` stores each row with a scale of
its own instead (`int8_rows.py`), and ignores these scales.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from workers.kvcache.int8_rows import dequantize_rows, quantize_rows

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448; a plain cast past it gives NaN
_SCALE_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for an `EngineConfig.kv_cache_dtype`."""
    return KV_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV scale (read by `checkpoint_scales`, not a weight)."""
    return _SCALE_KEY.search(name) is not None


@dataclass(frozen=True)
class KVScales:
    """Per layer: stored K = K / k[layer], stored V = V / v[layer]."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def unit(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


def checkpoint_scales(model_dir: Path, num_layers: int) -> KVScales | None:
    """The checkpoint's per-layer `k_scale` / `v_scale`, or None when it has none."""
    found: dict[tuple[str, int], float] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if m := _SCALE_KEY.search(key):
                    found[(m.group(2), int(m.group(1)))] = float(f.get_tensor(key).float().max())
    if not found:
        return None
    missing = [f"{kv}{i}" for kv in "kv" for i in range(num_layers) if (kv, i) not in found]
    if missing:
        raise ValueError(f"{model_dir} has KV scales for some layers only (lacks {missing[:4]})")
    return KVScales(
        tuple(found[("k", i)] for i in range(num_layers)),
        tuple(found[("v", i)] for i in range(num_layers)),
    )


def pool_scales(kv_dtype: torch.dtype, model_dir: Path, num_layers: int) -> KVScales | None:
    """An FP8 pool's scales: the checkpoint's, else None (1.0 for every layer), which the log
    warns of, as vLLM does: at 1.0, E4M3's 3 mantissa bits change greedy answers on some
    models, and `int8` (a scale per row) keeps them closer to a 16-bit cache. None for other
    pools."""
    if not is_fp8(kv_dtype):
        return None
    scales = checkpoint_scales(model_dir, num_layers)
    if scales is None:
        logger.warning(
            "kv_cache_dtype=fp8_e4m3: %s has no k_scale/v_scale, so K and V are stored at a "
            "scale of 1.0, which may change the model's answers (docs/fp8_kv_cache.md); "
            "kv_cache_dtype='int8' stays closer to a 16-bit cache at the same bytes",
            model_dir,
        )
    return scales


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x` as the pool stores it: cast, for FP8 divided by `scale` and saturated, for int8 as
    rows with their own scales (`scale` unused)."""
    if dtype == torch.int8:
        return quantize_rows(x)
    if not is_fp8(dtype):
        return x.to(dtype)
    if scale != 1.0:
        x = x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's uint8 view (indexed writes and gathers of FP8 are not implemented on
    every device and torch version; of bytes they are), any other tensor as it is."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored values back in `dtype` (the torch backend's reads)."""
    if x.dtype == torch.int8:
        return dequantize_rows(x, dtype)
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x
