"""The engine's speculator (`workers/spec/`), with the draft model's runner where there is one:
on the target's device, one rank, its own KV pool of `draft_kv_cache_memory_gb`."""

from __future__ import annotations

from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.kvcache.manager import KVManager
from workers.spec.speculator import Speculator


def build_speculator(cfg: EngineConfig, target: ModelRunner, kv: KVManager) -> Speculator | None:
    spec = cfg.speculative
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        assert spec.model is not None
        draft_cfg = cfg.model_copy(
            update=dict(
                model=spec.model,
                load_format="auto",
                kv_cache_memory_gb=spec.draft_kv_cache_memory_gb,
                num_kv_pages=None,
                max_model_len=None,  # its own: sequences past it are not drafted
                enable_prefix_caching=False,
                tensor_parallel_size=1,
                speculative=None,
                faults=(),
            )
        )
        draft = ModelRunner(draft_cfg)
        vocab, draft_vocab = target.model_config.vocab_size, draft.model_config.vocab_size
        if draft_vocab != vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is not the "
                             f"target's ({vocab})")  # fmt: skip
    return Speculator(spec, kv, target.max_model_len, draft)
