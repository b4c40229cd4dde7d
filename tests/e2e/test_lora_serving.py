"""LoRA adapters through Ray Serve and HTTP, in both modes (the shared configs/local.yaml apps,
with LoRA on): adapters loaded at run time answer with HF PEFT's greedy text, concurrently with
the base model, whose answer is unchanged; in disaggregated mode the prefill replica computes
the prompt's KV with the adapter and the decode replica goes on with it. Unloaded, a name is 404."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import hf_greedy
from tests.e2e.conftest import in_both_modes
from tests.lora_adapters import ALL_MODULES, make_lora_adapter, peft_model

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
TOKENS = 8
SUBSET = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("serve-loras")
    return {
        "a": make_lora_adapter(smollm2_dir, tmp / "a", 8, 16, ALL_MODULES, seed=1),
        "b": make_lora_adapter(smollm2_dir, tmp / "b", 4, 8, SUBSET, seed=2, rslora=True),
    }


@pytest.fixture(scope="module")
def expected(adapters, smollm2_dir: Path, hf_smollm2) -> dict[str, str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tok.encode(PROMPT)
    texts = {MODEL: tok.decode(hf_greedy(hf_smollm2, prompt, TOKENS))}
    for name, path in adapters.items():
        texts[name] = tok.decode(hf_greedy(peft_model(smollm2_dir, path), prompt, TOKENS))
    assert len(set(texts.values())) == 3
    return texts


def _complete(base: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def apps(local_apps: dict[str, str]) -> dict[str, str]:
    return local_apps


@in_both_modes
def test_adapters_loaded_at_run_time(apps, mode, adapters, expected) -> None:
    base = apps[mode]
    names = {n: f"{mode}-{n}" for n in adapters}
    for n, path in adapters.items():
        body = {"lora_name": names[n], "lora_path": str(path)}
        r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=30)
        assert r.status_code == 200, r.text
    try:
        cards = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            (MODEL, None),
            *[(names[n], MODEL) for n in sorted(adapters)],
        ]
        models = [MODEL, names["a"], names["b"], MODEL]
        with ThreadPoolExecutor(len(models)) as pool:  # one batch mixing them
            answers = list(pool.map(lambda m: _complete(base, m), models))
        for model, r in zip(models, answers):
            assert r.status_code == 200, r.text
            want = expected[model if model == MODEL else model.removeprefix(f"{mode}-")]
            assert r.json()["choices"][0]["text"] == want, model
    finally:
        for name in names.values():
            httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    r = _complete(base, names["a"])
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"The model `{names['a']}` does not exist."
