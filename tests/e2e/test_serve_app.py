"""The real thing: `serve run` in a subprocess, HTTP on localhost, the official openai client.

One application for the whole module (Serve takes ~20 s to start here): 2 router replicas,
1 prefill + 1 decode replica of SmolLM2 on CPU, KV handed over by NIXL, an API key configured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI, AuthenticationError, BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.app_process import REPO, app_process
from tests.waiting import wait_settled, wait_until
from workers.parallel.rendezvous import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.own_ray]

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port("127.0.0.1")
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["api_key"] = KEY
    args["engine"]["max_model_len"] = 512
    for pool in ("prefill", "decode"):
        args[pool]["num_cpus_per_rank"] = 0.5
    args["router"]["num_replicas"] = 2  # /metrics must sum the request metrics of both
    path = tmp_path_factory.mktemp("serve") / "app.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    with app_process(["serve", "run", str(path)], REPO, path.with_suffix(".log"), base):
        yield base


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def metrics(base: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("role", ""))] = s.value
    return out


def wait_idle(base: str) -> dict[tuple[str, str], float]:
    def idle() -> dict[tuple[str, str], float] | None:
        m = metrics(base)
        busy = sum(
            m.get((f"pdserve:{k}", r), 0)
            for k in ("num_requests_running", "kv_pages_pinned")
            for r in ("prefill", "decode")
        )
        return None if busy else m

    return wait_until(idle, 60, interval_s=0.5, what="the workers idle, no page pinned")


def test_chat_answers_like_hf_transformers(server: str, hf_smollm2, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    hf = hf_smollm2.generate(ids, max_new_tokens=30, do_sample=False)
    expected = tok.decode(hf[0, ids.shape[1] :], skip_special_tokens=True)
    r = client(server).chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=30
    )
    assert r.choices[0].message.content == expected == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == ids.shape[1]
    assert r.usage.completion_tokens == hf.shape[1] - ids.shape[1]


def test_stream_concatenation_equals_non_stream(server: str) -> None:
    c = client(server)
    prompt = "The three primary colors are"
    full = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text and len(text) > 0
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    chat = list(
        c.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=30, stream=True
        )
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chat)
        == "The capital of France is Paris."
    )


def test_32_concurrent_streams_complete_and_leave_nothing_pinned(server: str) -> None:
    async def one(c: AsyncOpenAI, i: int) -> int:
        n = 0
        stream = await c.completions.create(
            model=MODEL,
            prompt=f"Count to {i + 3}:",
            max_tokens=8,
            temperature=0.8,
            seed=i,
            stream=True,
        )
        async for ch in stream:
            n += len(ch.choices[0].text) if ch.choices else 0
        return n

    async def all_of_them() -> list[int]:
        async with AsyncOpenAI(
            base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    assert all(n > 0 for n in asyncio.run(all_of_them()))
    m = wait_idle(server)
    assert m[("pdserve:prompt_tokens_total", "prefill")] > 0
    assert m[("pdserve:generation_tokens_total", "decode")] >= 32 * 7
    assert m[("pdserve:nixl_bytes_transferred_total", "decode")] > 0
    assert (
        m[("pdserve:kv_pages_pinned", "prefill")] == m[("pdserve:kv_pages_pinned", "decode")] == 0
    )


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": "not a list"}, 400, "messages"),
        ({"messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi " * 600}]}, 400, None),
        ({"messages": CHAT, "model": "no-such-model"}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors_and_serving_goes_on(server, body, status, param) -> None:
    r = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    if param:
        assert param in (error["param"] or "") + error["message"]
    if "hi hi" in str(body):
        assert "maximum context length" in error["message"]
    # Greedy: a sampled reply may end (EOS) within its two tokens.
    ok = client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_bad_key_is_401_and_typed_errors_reach_the_client(server: str) -> None:
    bad = OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    with pytest.raises(NotFoundError):
        client(server).completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(BadRequestError):
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_the_key_guards_generation_and_tokenization_not_the_probes(server: str) -> None:
    """With a key, /invocations, /tokenize and /detokenize need it as /v1 does (each runs the
    model or its tokenizer); /health, /ping, /metrics and /version stay open."""
    keyed = {"Authorization": f"Bearer {KEY}"}
    bodies = {"invocations": {"max_tokens": 1}, "tokenize": {"prompt": "Hi"},
              "detokenize": {"tokens": [1]}}
    for path, body in bodies.items():
        r = httpx.post(f"{server}/{path}", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, path
        r = httpx.post(f"{server}/{path}", json=body, headers=keyed, timeout=30)
        assert r.status_code == (400 if path == "invocations" else 200), (path, r.text)
    for path in ("health", "ping", "metrics", "version"):
        assert httpx.get(f"{server}/{path}", timeout=30).status_code == 200, path


def test_client_disconnect_mid_stream_frees_pages_on_both_roles(server: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Write a very long story:",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    before = wait_idle(server)[("pdserve:generation_tokens_total", "decode")]
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    m = wait_idle(server)
    assert m[("pdserve:kv_pages_pinned", "decode")] == 0
    # Aborted: far fewer than the 480 tokens asked for were generated.
    assert m[("pdserve:generation_tokens_total", "decode")] - before < 240


def request_totals(base: str) -> tuple[float, float]:
    """(request_success_total over all reasons, e2e_request_latency_seconds_count) of a scrape."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    success = count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve:request_success_total":
                success += s.value
            elif s.name == "pdserve:e2e_request_latency_seconds_count":
                count += s.value
    return success, count


def test_every_router_replica_reports_the_requests_of_both(server: str) -> None:
    wait_idle(server)
    # Each replica posts its counts once a second: settled, both have posted their latest.
    before = wait_settled(lambda: request_totals(server), 1.5, 30, what="the request totals")
    assert before[0] == before[1]
    n = 6
    for _ in range(n):
        client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    want = (before[0] + n, before[1] + n)
    wait_until(lambda: request_totals(server) == want, 30, what=f"the request totals {want}")
    # Scrapes land on either replica: each must count the requests that both of them served.
    for _ in range(6):
        assert request_totals(server) == (before[0] + n, before[1] + n)
