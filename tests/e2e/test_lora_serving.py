"""LoRA adapters through Ray Serve and HTTP, in both modes (the shared configs/local.yaml apps,
with LoRA on): adapters loaded at run time answer with HF PEFT's greedy text, concurrently with
the base model, whose answer is unchanged; in disaggregated mode the prefill replica computes
the prompt's KV with the adapter and the decode replica goes on with it. Unloaded, a name is 404
and every replica of both pools frees the adapter within the bound the config gives."""

from __future__ import annotations

import re
import time
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
# router.lora_sync_period_s (1 s) + the stats board's post period (1 s) + an engine step, with
# room for a loaded two-core machine
RESIDENT_WITHIN_S = 15.0
RESIDENT = re.compile(r"^pdserve:lora_resident_adapters\{(.*)\} (\S+)$", re.M)


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


def _resident(base: str) -> dict[str, set[str]]:
    """Adapter -> the roles (/metrics' `lora_resident_adapters`) with a replica holding it."""
    out: dict[str, set[str]] = {}
    for labels, value in RESIDENT.findall(httpx.get(f"{base}/metrics", timeout=30).text):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value) > 0:
            out.setdefault(named["lora_name"], set()).add(named["role"])
    return out


def _wait_resident(base: str, want: dict[str, set[str]], names: list[str]) -> None:
    """Until the resident roles of `names` are `want` (absent: held nowhere), within the bound."""
    deadline = time.monotonic() + RESIDENT_WITHIN_S
    while True:
        seen = {n: roles for n, roles in _resident(base).items() if n in names}
        if seen == want or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert seen == want


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
        # both pools computed with them: each holds them (a device slot and a host copy)
        roles = {"colocated"} if mode == "colocated" else {"prefill", "decode"}
        _wait_resident(base, {n: roles for n in names.values()}, list(names.values()))
    finally:
        for name in names.values():
            httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    r = _complete(base, names["a"])
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"The model `{names['a']}` does not exist."
    _wait_resident(base, {}, list(names.values()))  # freed on every replica of both pools
