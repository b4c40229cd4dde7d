"""LoRA adapters offline: greedy tokens equal HF PEFT's for a batch mixing the base model and
two adapters of different ranks (one rsLoRA, on a subset of the modules), with fewer device
slots than adapters; the prefix cache never shares pages across adapters; bad adapters fail
with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.conftest import hf_greedy_batch
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model
from workers import LLM, LoRARequest, SamplingParams
from workers.config import EngineConfig
from workers.kvcache.kv_events import LORA_SALT, prefix_cache_ids

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[LoRARequest]:
    tmp = tmp_path_factory.mktemp("loras")
    a = make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1)
    subset = ["q_proj", "v_proj", "o_proj", "down_proj"]
    b = make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, subset, seed=2, rslora=True)
    return [
        LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(a)),
        LoRARequest(lora_name="b", lora_int_id=2, lora_path=str(b)),
    ]


@pytest.fixture(scope="module")
def references(
    adapters: list[LoRARequest], hf_smollm2, smollm2_dir: Path
) -> tuple[list[list[int]], dict[str | None, list[list[int]]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    refs: dict[str | None, list[list[int]]] = {}
    refs[None] = hf_greedy_batch(hf_smollm2, prompts, NEW_TOKENS)
    for lora in adapters:
        model = peft_model(smollm2_dir, Path(lora.lora_path))
        refs[lora.lora_name] = hf_greedy_batch(model, prompts, NEW_TOKENS)
    return prompts, refs


@pytest.mark.parametrize(("max_loras", "folded"), [(2, False), (1, False), (2, True)])
def test_mixed_batch_equals_peft(adapters, references, max_loras: int, folded: bool) -> None:
    """Base, a and b requests interleaved in one batch; with one slot the scheduler runs one
    adapter per step and the slot is refilled between them. `folded`: the norm gains in the
    weights (as a GPU decode step runs, `fold_norm_gains`), LoRA steps on that path too: q/k/v's
    and gate/up's A take the gains, o's and down's products go into the residual stream."""
    prompts, refs = references
    assert refs["a"] != refs[None] and refs["b"] != refs[None] and refs["a"] != refs["b"]
    loras = [None, *adapters] * len(prompts)
    batch = [p for p in prompts for _ in range(3)]
    llm = LLM(enable_lora=True, max_loras=max_loras, max_lora_rank=8, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if folded:  # before the adapters fill their slots, which fold the gains into A
        model.fold_norm_gains()
    assert model.norms_folded == folded
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    for i, (out, lora) in enumerate(zip(outs, loras)):
        name = None if lora is None else lora.lora_name
        assert out.token_ids == refs[name][i // 3], f"prompt {i // 3} under {name}"


def test_prefix_cache_keys_pages_by_adapter(adapters, references) -> None:
    prompts, refs = references
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, page_size=2)
    a, b = adapters
    first = llm.generate(prompts[0], GREEDY, lora_request=a)[0]
    other = llm.generate(prompts[0], GREEDY, lora_request=b)[0]
    base = llm.generate(prompts[0], GREEDY)[0]
    again = llm.generate(prompts[0], GREEDY, lora_request=a)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens > 0
    assert [first.token_ids, other.token_ids, base.token_ids, again.token_ids] == [
        refs["a"][0],
        refs["b"][0],
        refs[None][0],
        refs["a"][0],
    ]
    # unloading frees the adapter's cached pages and its slot; the others keep theirs
    cached = llm.engine.kv.radix.num_cached_pages
    assert llm.engine.remove_lora(a.lora_int_id)
    assert llm.engine.kv.radix.num_cached_pages < cached
    assert a not in llm.engine.runner.lora.resident and b in llm.engine.runner.lora.resident
    assert llm.generate(prompts[0], GREEDY, lora_request=b)[0].num_cached_tokens > 0


def test_cache_ids_keep_adapters_apart() -> None:
    ids = [5, 7, 9]
    assert prefix_cache_ids(ids, 0) is ids
    assert prefix_cache_ids(ids, 3) == [3 * LORA_SALT + t for t in ids]
    assert set(prefix_cache_ids(ids, 1)).isdisjoint(prefix_cache_ids(ids, 2))


def test_bad_adapters_fail_clearly(adapters, tmp_path: Path) -> None:
    a = adapters[0]
    base_only = LLM()
    with pytest.raises(ValueError, match="need an engine with enable_lora"):
        base_only.engine.add_request(_request(a))
    llm = LLM(enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4"):
        llm.engine.add_request(_request(a))
    missing = a.model_copy(update={"lora_path": str(tmp_path)})
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.add_request(_request(missing))
    # an adapter made for another model: its shapes do not fit
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((Path(adapters[1].lora_path) / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    import torch
    from safetensors.torch import save_file

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 100), key.format("B"): torch.zeros(576, 4)},
              str(bad / "adapter_model.safetensors"))  # fmt: skip
    wrong = a.model_copy(update={"lora_path": str(bad), "lora_int_id": 9})
    with pytest.raises(ValueError, match=r"layer 0 q_proj has A \(4, 100\)"):
        llm.engine.add_request(_request(wrong))


def test_lora_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="max_cpu_loras .1. must be at least max_loras .2."):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValidationError, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=0)


def _request(lora: LoRARequest):  # noqa: ANN202
    from workers.protocol import GenerateRequest

    return GenerateRequest(request_id=f"r{lora.lora_int_id}", prompt_token_ids=(1, 2), lora=lora)
