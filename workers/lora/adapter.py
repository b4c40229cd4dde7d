"""A PEFT LoRA adapter read from its directory and checked against the base model.

The adapter's weights stay on the host in float32, the scaling (alpha / r, or alpha / sqrt(r)
with rsLoRA) multiplied into B: a device slot then adds `(x A^T) B^T` and nothing more.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.model.config import ModelConfig
from workers.protocol import LoRARequest

# The projections an adapter may target, by their PEFT module names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this base model (the message says why)."""


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    # (layer, PEFT module name) -> (A [rank, in], B [out, rank] times the scaling), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a base projection, unsharded."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    return shapes[module]


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read `request`'s PEFT directory; a LoRAAdapterError says what does not fit."""
    path = Path(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"{where}: no adapter_config.json")
    conf = json.loads(config_file.read_text())
    tensors = _read_tensors(path, where)
    # before the options: PEFT adds rank/alpha patterns to an adapter on fused experts
    if experts := [k for k in tensors if ".experts." in k]:
        raise LoRAAdapterError(
            f"{where}: tensor {experts[0]!r} targets expert weights (LoRA on MoE experts is not "
            "supported)"
        )
    _check_config(conf, where)
    rank, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(
                f"{where}: tensor {key!r} targets no supported module of {TARGET_MODULES}"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAAdapterError(f"{where}: module {module!r} is not one of {TARGET_MODULES}")
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{where}: layer {layer} but the model has {cfg.num_layers}")
        parts.setdefault((layer, module), {})[ab] = tensor.float()
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        n_in, n_out = module_shape(cfg, module)
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoRAAdapterError(
                f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"the base model needs A ({rank}, {n_in}) and B ({n_out}, {rank})"
            )
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise LoRAAdapterError(f"{where}: no LoRA weights")
    return LoRAAdapter(request, rank, weights)


def _check_config(conf: dict, where: str) -> None:
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {conf.get('peft_type')!r}, not LORA")
    if "r" not in conf:
        raise LoRAAdapterError(f"{where}: adapter_config.json has no rank 'r'")
    unsupported = {
        "use_dora": conf.get("use_dora"),
        "rank_pattern": conf.get("rank_pattern"),
        "alpha_pattern": conf.get("alpha_pattern"),
        "modules_to_save": conf.get("modules_to_save"),
    }
    if conf.get("bias", "none") != "none":
        unsupported["bias"] = conf["bias"]
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise LoRAAdapterError(f"{where}: unsupported adapter options {bad}")


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.is_file():
        return dict(torch.load(pt, map_location="cpu", weights_only=True))
    raise LoRAAdapterError(f"{where}: no adapter_model.safetensors (or .bin)")
