"""The OpenAI app on the real colocated engine (SmolLM2, CPU), via httpx and the `openai` client.

Generation is slow on a shared CPU, so the requests that generate run concurrently in two
module fixtures (one engine batch each) and the tests assert on their results.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import uvicorn

from router.openai_api import LocalBackend, build_openai_app
from router.params import generation_defaults
from tests.unit.conftest import MODEL, http
from tests.waiting import async_wait_until
from workers.engine.async_engine import AsyncEngine
from workers.protocol import GenerateRequest, RequestOutput

pytestmark = pytest.mark.asyncio(loop_scope="module")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."
PROMPT = "Once upon a time"


def client(app: Any, key: str = "EMPTY") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))


def events(body: str) -> list[Any]:
    """An SSE body as its decoded events; asserts the framing is exactly `data: ...\\n\\n`."""
    assert body.endswith("\n\n") and not body.startswith("\n")
    raw = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in raw)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in raw]


async def sse(app: Any, path: str, body: dict[str, Any]) -> list[Any]:
    async with http(app) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return events(r.text)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_runs(app: Any) -> dict[str, Any]:
    oc = client(app)
    greedy = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 12}
    nulls = {"n": None, "logprobs": None, "stream": None, "best_of": None, "echo": None}
    runs = await asyncio.gather(
        oc.chat.completions.create(**greedy, extra_body=nulls),  # null means the default
        oc.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True}),
        sse(app, "/v1/chat/completions", {**greedy, "stream": True, "n": 2,
                                           "stream_options": {"include_usage": True}}),
        oc.chat.completions.create(**{**greedy, "max_tokens": 3}, logprobs=True, top_logprobs=3),
    )
    stream_chunks = [c async for c in runs[1]]
    return dict(plain=runs[0], stream=stream_chunks, raw=runs[2], logprobs=runs[3])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def completion_runs(app: Any) -> dict[str, Any]:
    oc = client(app)
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    seeded = {**base, "temperature": 1.0, "seed": 7, "n": 2}
    runs = await asyncio.gather(
        oc.completions.create(**base, logprobs=2,
                              extra_body={"best_of": 1, "no_such_field": [1], "top_k": 0}),
        oc.completions.create(**base, stream=True),
        oc.completions.create(**seeded),
        oc.completions.create(**seeded),
        sse(app, "/v1/completions", {**base, "prompt": [PROMPT, "The sky is"], "stream": True,
                                     "stream_options": {"include_usage": True}}),
    )
    return dict(plain=runs[0], stream=[c async for c in runs[1]], seeded=runs[2:4], raw=runs[4])


# ---- chat --------------------------------------------------------------------------------------
async def test_greedy_chat_answers_paris_with_right_usage(chat_runs, engine) -> None:
    r = chat_runs["plain"]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == PARIS
    assert r.choices[0].finish_reason == "stop"
    prompt_len = len(engine.engine.tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.completion_tokens == 8  # "The capital of France is Paris." + <|im_end|>
    assert r.usage.total_tokens == prompt_len + 8
    assert r.usage.prompt_tokens_details is None  # off by default, as vLLM's


async def test_logit_bias_and_penalties_reach_the_engine(app, engine) -> None:
    tok = engine.engine.tokenizer
    paris = {tok.encode(w, add_special_tokens=False)[0] for w in (" Paris", "Paris")}
    r = await client(app).chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=12, frequency_penalty=0.5,
        presence_penalty=0.5, logit_bias={str(t): -100 for t in paris},
        extra_body={"repetition_penalty": 1.1})
    content = r.choices[0].message.content
    assert content and "Paris" not in content


async def test_generation_config_supplies_omitted_sampling_fields(engine, tmp_path) -> None:
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0, "top_p": 0.9, "do_sample": True, "top_k": None, "eos_token_id": 2}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.0, "top_p": 0.9}
    greedy_by_default = build_openai_app(LocalBackend(engine), engine.engine.tokenizer, MODEL,
                                         engine.engine.max_model_len, sampling_defaults=defaults)
    oc = client(greedy_by_default)
    r = await oc.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12)
    assert r.choices[0].message.content == PARIS  # temperature 0 though the request had none


async def test_chat_stream_concatenates_to_the_non_stream_text(chat_runs) -> None:
    chunks = chat_runs["stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PARIS
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


async def test_chat_sse_is_role_first_then_content_then_usage_then_done(chat_runs) -> None:
    ev = chat_runs["raw"]
    assert ev[-1] == "[DONE]"
    roles, content, usage = ev[:2], ev[2:-2], ev[-2]
    assert [r["choices"][0]["index"] for r in roles] == [0, 1]
    assert all(r["choices"][0]["delta"] == {"role": "assistant", "content": ""} for r in roles)
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in content)
    assert len({e["id"] for e in ev[:-1]}) == 1
    for i in (0, 1):
        mine = [e["choices"][0] for e in content if e["choices"][0]["index"] == i]
        assert "role" not in mine[0]["delta"]
        assert "".join(c["delta"]["content"] for c in mine) == PARIS
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16


async def test_chat_logprobs_have_top_logprobs_best_first(chat_runs) -> None:
    lp = chat_runs["logprobs"].choices[0].logprobs.content
    assert [t.token for t in lp] == ["The", " capital", " of"]
    for t in lp:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token and t.logprob <= 0


# ---- completions -------------------------------------------------------------------------------
async def test_completion_with_logprobs_and_ignored_unknown_fields(completion_runs, engine) -> None:
    r = completion_runs["plain"]
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == len(engine.engine.tokenizer.encode(PROMPT))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 2 <= len(top) <= 3


async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(app, engine) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1. Every
    prompt token but the first gets its logprob, in the streamed first chunk too."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    ids = engine.engine.tokenizer.encode(PROMPT)
    async with http(app) as c:
        whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        chunks = events((await c.post("/v1/completions", json={**body, "stream": True})).text)
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"]) == whole["text"]
    assert whole["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x < 0 for x in lp["token_logprobs"][1:])
    assert all(lp["tokens"][i] in lp["top_logprobs"][i] for i in range(1, len(ids) + 1))
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"] == lp["token_logprobs"][: len(first["token_logprobs"])]
    assert len(first["tokens"]) >= len(ids)


async def test_prompt_logprobs_as_vllm_returns_them(app, engine) -> None:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) the token's own entry and
    the top N, keyed by token id, with ranks; in each completion choice, and once for chat."""
    ids = engine.engine.tokenizer.encode(PROMPT)
    async with http(app) as c:
        comp = (await c.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})).json()
        chat = (await c.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0})).json()
        streamed = await c.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    plp = comp["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for t, entry in zip(ids[1:], plp[1:]):
        mine = entry[str(t)]
        assert mine["rank"] >= 1 and mine["logprob"] <= 0 and mine["decoded_token"]
        by_rank = {e["rank"]: e["logprob"] for e in entry.values()}
        assert len(entry) in (2, 3) and by_rank[1] >= by_rank[2]  # the top 2, and its own
        assert by_rank[mine["rank"]] == mine["logprob"]
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # its own entry only
    assert streamed.status_code == 400
    plain = (await http(app).post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1})).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


async def test_completion_stream_concatenates_to_the_non_stream_text(completion_runs) -> None:
    chunks = completion_runs["stream"]
    assert "".join(c.choices[0].text for c in chunks) == completion_runs["plain"].choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_every_token_is_a_chunk_even_without_text_yet(app) -> None:
    """As in vLLM, with `stream_interval_ms` 0: a token whose text is held back (here: it could
    start the stop string) is still a chunk, with empty content, so clients that time chunks
    see every token."""
    ev = await sse(app, "/v1/chat/completions", {
        "model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 12, "stream": True,
        "stop": ["Paris is"], "stream_options": {"include_usage": True}})  # fmt: skip
    role, *content, usage, done = ev
    assert role["choices"][0]["delta"]["role"] == "assistant" and done == "[DONE]"
    texts = [e["choices"][0]["delta"]["content"] for e in content]
    assert len(texts) == usage["usage"]["completion_tokens"] and "" in texts
    assert "".join(texts) == PARIS


async def test_n_seeded_choices_are_indexed_and_reproducible(completion_runs) -> None:
    a, b = completion_runs["seeded"]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens == 4  # prompt counted once


async def test_completion_sse_for_a_batch_of_prompts(completion_runs) -> None:
    ev = completion_runs["raw"]
    assert ev[-1] == "[DONE]"
    *content, usage = ev[:-1]
    assert {e["choices"][0]["index"] for e in content} == {0, 1}
    assert all(e["object"] == "text_completion" for e in content)
    assert usage["usage"]["prompt_tokens"] == 4 + 3
    assert usage["usage"]["completion_tokens"] == 8
    texts = ["".join(e["choices"][0]["text"] for e in content if e["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert texts[0] == completion_runs["plain"].choices[0].text


# ---- bad input ---------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": FRANCE, "max_tokens": 1}
BAD_CHAT = [
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "temperature": -0.5}, "temperature"),
    ({**CHAT, "temperature": math.inf}, "temperature"),
    ({**CHAT, "temperature": math.nan}, "temperature"),
    ({**CHAT, "repetition_penalty": math.inf}, "repetition_penalty"),
    ({**CHAT, "logit_bias": {"5": math.nan}}, "logit_bias"),
    ({**CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({**CHAT, "n": 2, "best_of": 1}, "best_of"),
    ({**CHAT, "n": 2, "best_of": 3}, "best_of"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "stop": 3}, "stop"),
    ({**CHAT, "stop": [""]}, "stop"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"five": 1}}, "logit_bias"),
    ({**CHAT, "max_tokens": 9000}, "max_tokens"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),  # OpenAI's roles
    ({**CHAT, "use_beam_search": True}, "use_beam_search"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
async def test_bad_chat_request_is_400_naming_the_field(app, body, param) -> None:
    async with http(app) as c:  # json.dumps, unlike httpx, writes Infinity and NaN
        r = await c.post("/v1/chat/completions", content=json.dumps(body),
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert err["param"].startswith(param) and err["message"]


async def test_bad_completion_requests_are_400(app) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    async with http(app) as c:
        for body in ({**base, "prompt": 5}, {**base, "prompt": []}, {**base, "prompt": [-1]},
                     {**base, "logprobs": -1}, {**base, "prompt_logprobs": 21},
                     {**base, "max_tokens": 0}, {**base, "suffix": "x"},
                     {**base, "prompt": [60000]}, {**base, "prompt": [60000], "stream": True},
                     {**base, "prompt": [2**32], "echo": True},
                     {**base, "logit_bias": {"60000": 1}}):
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400 and "error" in r.json(), body
        r = await c.post("/v1/completions", content=b"{not json", headers={
            "content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "BadRequestError"
        assert err["param"] is None and "not valid JSON at character 1" in err["message"]


async def test_text_that_is_not_unicode_is_400_saying_so(app) -> None:
    lone = "caf\ud800"  # JSON can escape a lone surrogate; no tokenizer encodes one
    bodies = [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": lone}]},
               "messages.0.content"),
              ("/v1/completions", {"model": MODEL, "prompt": ["ok", lone]}, "prompt.1"),
              ("/tokenize", {"model": MODEL, "prompt": lone}, "prompt")]
    async with http(app) as c:
        for path, body, where in bodies:  # json.dumps escapes it; httpx would encode it
            r = await c.post(path, content=json.dumps(body),
                             headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert f"{where} holds a lone surrogate (U+D800)" in message and "UTF-8" in message
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "min_tokens": 17})
        assert r.status_code == 400 and "min_tokens (17) must not exceed max_tokens (16)" in r.text


async def test_too_long_prompt_says_maximum_context_length(app, engine) -> None:
    oc = client(app)
    long_prompt = "hello " * (engine.engine.max_model_len + 10)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await oc.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        await oc.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9000)
    assert "too large" in str(e.value)


async def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(app, engine) -> None:
    """vLLM's `truncate_prompt_tokens`: a prompt longer than the context runs on its last k
    tokens (usage counts k; echo gives their text; the answer is the one those tokens get as
    the prompt), in chat too; -1 keeps what the context holds; more than the context, or 0,
    is 400 naming the field."""
    limit = engine.engine.max_model_len
    long_prompt = "hello " * (limit + 10)
    kept = engine.engine.tokenizer.encode(long_prompt)[-5:]
    greedy = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    async with http(app) as c:
        cut = await c.post("/v1/completions", json={**greedy, "prompt": long_prompt, "echo": True,
                                                    "truncate_prompt_tokens": 5})  # fmt: skip
        sent = await c.post("/v1/completions", json={**greedy, "prompt": kept})
        chat = await c.post("/v1/chat/completions", json={**greedy, "messages": FRANCE,
                                                          "truncate_prompt_tokens": 3})  # fmt: skip
        whole = await c.post("/v1/completions", json={**greedy, "prompt": PROMPT,
                                                      "truncate_prompt_tokens": -1})  # fmt: skip
        plain = await c.post("/v1/completions", json={**greedy, "prompt": PROMPT})
        bad = [await c.post("/v1/completions", json={**greedy, "prompt": PROMPT,
                                                     "truncate_prompt_tokens": k})
               for k in (limit + 1, 0)]  # fmt: skip
    assert cut.status_code == sent.status_code == chat.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 5
    text = engine.engine.tokenizer.decode(kept)
    assert cut.json()["choices"][0]["text"] == text + sent.json()["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == 3
    assert whole.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    for r in bad:
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert "greater than max_model_len" in bad[0].text


async def test_bad_words_keep_a_word_out_of_the_answer(app) -> None:
    """vLLM's `bad_words` over HTTP: the greedy answer that says "Paris" does not with it."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0}  # fmt: skip
    async with http(app) as c:
        plain = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        r = await c.post("/v1/completions", json={**body, "bad_words": ["Paris"]})
    assert "Paris" in plain
    assert r.status_code == 200 and "Paris" not in r.json()["choices"][0]["text"]


async def test_cache_salt_reaches_the_engine_and_an_empty_one_is_400(app, engine) -> None:
    """vLLM's `cache_salt`: the engine's request carries it (its pages are keyed by it:
    tests/unit/test_cache_salt.py); an empty salt is 400 naming the field."""
    seen: list[str | None] = []
    add = engine.engine.add_request
    engine.engine.add_request = lambda req: seen.append(req.cache_salt) or add(req)  # type: ignore[method-assign]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    try:
        async with http(app) as c:
            ok = await c.post("/v1/completions", json={**body, "cache_salt": "tenant-a"})
            bad = await c.post("/v1/completions", json={**body, "cache_salt": ""})
    finally:
        del engine.engine.add_request
    assert ok.status_code == 200 and seen == ["tenant-a"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


async def test_a_priority_under_the_fcfs_policy_is_400_as_vllm(app) -> None:
    """vLLM's `priority` needs `scheduling_policy: priority` (tests/unit/
    test_priority_scheduling.py); this app's engine runs the default fcfs."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    async with http(app) as c:
        bad = await c.post("/v1/completions", json={**body, "priority": 3})
        zero = await c.post("/v1/completions", json={**body, "priority": 0})
        null = await c.post("/v1/completions", json={**body, "priority": None})
    assert bad.status_code == 400
    assert "priority scheduling is not enabled" in bad.json()["error"]["message"]
    assert zero.status_code == 200 and null.status_code == 200


async def test_unknown_model_is_404_and_the_server_keeps_serving(app) -> None:
    oc = client(app)
    with pytest.raises(openai.NotFoundError) as e:
        await oc.chat.completions.create(model="gpt-9", messages=FRANCE, max_tokens=1)
    assert e.value.status_code == 404
    assert e.value.body["message"] == "The model `gpt-9` does not exist."
    async with http(app) as c:
        r = await c.post("/v1/no/such/path", json={})
    assert r.status_code == 404 and "error" in r.json()
    ok = await oc.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 1


async def test_api_key_guards_all_but_the_probes(engine) -> None:
    """Generation and tokenization need the key (/invocations too, unless opened); the probes,
    /metrics and /version do not, as in vLLM."""
    tokenizer, max_len = engine.engine.tokenizer, engine.engine.max_model_len
    keyed = build_openai_app(LocalBackend(engine), tokenizer, MODEL, max_len, api_key="sekret")
    for key in ("EMPTY", "sekret2"):
        with pytest.raises(openai.AuthenticationError):
            await client(keyed, key).models.list()
    bad = {"messages": "not even valid"}  # a 400 once past the key: nothing generates
    async with http(keyed) as c:
        for path in ("/v1/chat/completions", "/invocations", "/tokenize", "/detokenize"):
            r = await c.post(path, json=bad)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, path
            r = await c.post(path, json=bad, headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 400, path
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert (await c.get(path)).status_code == 200, path
    models = await client(keyed, "sekret").models.list()
    assert [m.id for m in models.data] == [MODEL]
    opened = build_openai_app(LocalBackend(engine), tokenizer, MODEL, max_len, api_key="sekret",
                              open_invocations=True)
    async with http(opened) as c:
        assert (await c.post("/invocations", json=bad)).status_code == 400
        assert (await c.post("/tokenize", json=bad)).status_code == 401


# ---- the other endpoints -----------------------------------------------------------------------
async def test_models_health_tokenize(app, engine) -> None:
    async with http(app) as c:
        models = (await c.get("/v1/models")).json()
        health = await c.get("/health")
        tok = (await c.post("/tokenize", json={"model": MODEL, "prompt": PROMPT})).json()
        detok = (await c.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"]
    assert card["max_model_len"] == engine.engine.max_model_len
    assert health.status_code == 200 and health.content == b""
    assert tok["tokens"] == engine.engine.tokenizer.encode(PROMPT) and tok["count"] == 4
    assert detok == {"prompt": PROMPT}


async def test_metrics_expose_pdserve_names(app, chat_runs) -> None:
    async with http(app) as c:
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_pages_pinned", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_success_total"):
        assert f"pdserve:{name}{{" in text, name
    assert 'role="colocated"' in text and f'model_name="{MODEL}"' in text
    assert f'pdserve:request_success_total{{finished_reason="stop",model_name="{MODEL}"}}' in text


# ---- streams that end early --------------------------------------------------------------------
async def wait_idle(engine: AsyncEngine) -> Any:
    def idle() -> Any:
        stats = engine.stats()
        busy = stats.num_running or stats.num_waiting or stats.kv_pages_pinned
        return None if busy else stats

    return await async_wait_until(idle, 10, what="the engine idle, no page pinned")


class FailsAfterOneChunk(LocalBackend):
    """The real engine behind a backend whose connection breaks after the first chunk."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stream = self.engine.generate(req)
        try:
            yield await anext(stream)
            raise ConnectionError("decode replica lost")
        finally:
            await stream.aclose()


async def test_mid_stream_failure_is_an_error_event_then_done(engine) -> None:
    broken = build_openai_app(FailsAfterOneChunk(engine), engine.engine.tokenizer, MODEL,
                              engine.engine.max_model_len)
    ev = await sse(broken, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50,
                                                "ignore_eos": True, "stream": True})
    assert ev[-1] == "[DONE]" and "choices" in ev[0]
    assert ev[-2]["error"]["code"] == 500 and "decode replica lost" in ev[-2]["error"]["message"]
    with pytest.raises(openai.APIError, match="decode replica lost"):
        async for _ in await client(broken).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=50, stream=True):
            pass
    with pytest.raises(openai.InternalServerError, match="decode replica lost"):
        await client(broken).completions.create(model=MODEL, prompt=PROMPT, max_tokens=50)
    stats = await wait_idle(engine)
    assert stats.num_running == 0 and stats.kv_pages_pinned == 0


async def test_client_disconnect_mid_stream_aborts_the_request(app, engine) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        await async_wait_until(lambda: server.started, 10, interval_s=0.02, what="uvicorn up")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient() as c, c.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            assert engine.stats().num_running == 1
        stats = await wait_idle(engine)
        assert stats.num_running == 0 and stats.kv_pages_pinned == 0
        async with http(app) as h:
            text = (await h.get("/metrics")).text
        assert f'request_success_total{{finished_reason="abort",model_name="{MODEL}"}} 1.0' in text
        assert f'request_errors_total{{kind="abort",model_name="{MODEL}"}} 1.0' in text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def test_chunks_of_several_tokens_keep_every_tokens_logprobs(app, engine) -> None:
    """A stream interval (a deployment's default) lets one chunk carry several tokens; the SSE
    events of completions and chat then list each token's logprobs and text offset as the
    stream of a chunk per token does."""
    comp = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "stream": True}  # fmt: skip
    chat = {"model": MODEL, "messages": FRANCE, "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "stream": True}  # fmt: skip

    async def runs() -> tuple[list[Any], list[Any]]:
        return (await sse(app, "/v1/completions", comp),
                await sse(app, "/v1/chat/completions", chat))  # fmt: skip

    def close(a: Any, b: Any) -> bool:  # the second run reads a cached prefix: last digits
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-4)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    def folded(ev: list[Any]) -> tuple[int, dict[str, list[Any]]]:
        """(events with logprobs, their lists concatenated key by key)"""
        lists: dict[str, list[Any]] = {}
        carried = 0
        for e in ev[:-1]:  # the last is [DONE]
            lp = e["choices"][0].get("logprobs")
            if lp:
                carried += 1
                for key, values in lp.items():
                    lists.setdefault(key, []).extend(values)
        return carried, lists

    each = await runs()
    engine.stream_interval_s = 600.0
    try:
        merged = await runs()
    finally:
        engine.stream_interval_s = 0.0
    for one, many in zip(each, merged, strict=True):
        (n_one, lists_one), (n_many, lists_many) = folded(one), folded(many)
        assert n_one == 6 and n_many == 2  # the first token alone, then the other five
        assert close(lists_many, lists_one) and len(next(iter(lists_one.values()))) == 6
