"""A schema-driven fuzz of every endpoint on the real engine (CPU): no 5xx, ever.

Hypothesis draws request bodies from the request models' fields (`router.protocol`): well-formed
but odd ones (edge values, unknown fields, long and odd strings, prompt lists, n, stream options,
logit_bias keys, content parts and chat template kwargs) and malformed ones (a field set to a
value of the wrong type or out of range, a required field gone, a body that is no object, bytes
that are no JSON). Every answer must be below 500; a 4xx has OpenAI's error body, a 200 is strict
JSON or SSE that ends in `[DONE]` without a server error. Afterwards the server is healthy and
the engine holds no request and no page.

Generation stays cheap: every body that can be accepted asks for at most 3 tokens per choice;
mutations of the fields that set the amount of work (max_tokens, n) only draw refused values;
the engine serves the tiny random Llama with SmolLM2's tokenizer and chat template (the answers'
shape is under test, not the model's text; a step costs ~1/30 of SmolLM2's).
Drawn too, since the router refuses them with a 400: non-finite numbers in any field,
min_tokens above max_tokens, lone surrogates in text.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from router.params import UNSUPPORTED_EXTRAS
from router.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from tests.engine_checks import drain_and_check_released
from tests.unit.conftest import MODEL, http
from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine

VOCAB = 49152  # SmolLM2's
# Reproducible in CI; 40-70 s of requests on 2 busy CPU cores (chat's template and generation
# cost the most, so it gets fewer examples than completions).
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
JSON = "application/json"

# ---- values ------------------------------------------------------------------------------------
ODD_TEXT = ["", " ", "\x00", "\n\n", "<|im_end|>", "<|im_start|>system\n", "<|endoftext|>",
            "{{ raise_exception('x') }}", "{% for %}", "\u202eevil", "\ufeff", "\uffff",
            "e\u0301\u0301\u0301", "🦙" * 8, "Ω≈ç√∫", "NaN", "null", "-1", "a\ud800b", "\udfff"]
LONG_TEXT = "hello " * 9000  # beyond SmolLM2's 8192-token context
text = st.text(max_size=24) | st.sampled_from(ODD_TEXT)  # ODD_TEXT holds lone surrogates
# A URL is UTF-8: no lone surrogates in a query (the client could not send it).
url_text = text.filter(lambda t: not any("\ud800" <= c <= "\udfff" for c in t))
long_text = st.sampled_from([LONG_TEXT, "🦙" * 9000, "a" * 100_000])
token_id = st.integers(0, VOCAB - 1)
odd_int = st.integers() | st.sampled_from([-1, 0, VOCAB, 2**31, 2**63, 2**64, 10**40])
finite = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | odd_int | st.floats() | text
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8)
finite_values = st.recursive(
    st.none() | st.booleans() | odd_int | finite | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8)


def nested(depth: int) -> Any:
    """Lists and objects `depth` deep, alternating."""
    value: Any = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


deep = st.integers(1, 400).map(nested)

# The fields whose valid values set the work done: mutations draw only what the router refuses,
# and never drop a limit (chat's default is the whole context).
LIMITS = {"max_tokens", "max_completion_tokens"}
COSTLY = LIMITS | {"n", "min_tokens", "prompt", "messages"}
refused_count = (st.integers(max_value=0) | st.integers(min_value=10**6)
                 | st.sampled_from(["ten", "", "1.5", [], {}, [3], 1.5, -0.5]))
KNOWN = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
         | set(TokenizeRequest.model_fields) | set(UNSUPPORTED_EXTRAS)
         | {"tokens", "best_of", "response_format", "echo"})
unknown_fields = st.dictionaries(text.filter(lambda k: k not in KNOWN), json_values, max_size=3)

# Fields we refuse unless neutral (`router.params.check_supported`), neutral values included;
# a body gets at most one, so that most bodies are served.
REFUSED: dict[str, st.SearchStrategy[Any]] = {
    "suffix": st.sampled_from([None, "", "x"]),
    "use_beam_search": st.booleans(),
    "length_penalty": st.sampled_from([1.0, 0.5, None]),
    "allowed_token_ids": st.none() | st.lists(token_id, max_size=2),
    "guided_json": st.none() | st.just({"type": "object"}),
    "guided_choice": st.none() | st.just(["a", "b"]),
    "structured_outputs": st.none() | st.just({"regex": "a+"}),
    "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f"}}]]),
    "tool_choice": st.sampled_from(["auto", "none", {"type": "function"}]),
    "functions": st.sampled_from([[], [{"name": "f"}]]),
    "response_format": st.sampled_from([None, "text", {"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {}}, []]),
    "best_of": st.none() | st.integers(0, 4),
}
refused = st.just({}) | st.sampled_from(sorted(REFUSED)).flatmap(
    lambda name: REFUSED[name].map(lambda value: {name: value}))
# Keys Python reads as token ids (" 5 ", "5_0", "٣" are 5, 50 and 3), and keys it does not.
valid_bias = st.dictionaries(token_id.map(str) | st.sampled_from([" 5 ", "5_0", "٣", "+7", "-0"]),
                             st.floats(-100, 100), max_size=4)
odd_bias = st.dictionaries(odd_int.map(str) | st.sampled_from(["", "1e3", "0x10", "five"]),
                           st.floats(-150, 150), max_size=4)


# ---- well-formed but odd bodies ----------------------------------------------------------------
def sampling(max_tokens: int) -> dict[str, st.SearchStrategy[Any]]:
    """The shared sampling fields, all optional; min_tokens at most 2 above `max_tokens`."""
    return {
        "model": st.sampled_from([MODEL, None]),
        "temperature": st.sampled_from([0, 0.0, 1e-30, 1e30, math.inf, math.nan]) | st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True) | st.just(1e-30),
        "top_k": st.sampled_from([-1, 0, 1, VOCAB, VOCAB + 1, 2**40]),
        "min_p": st.floats(0, 1),
        "seed": st.none() | odd_int,
        "stop": st.none() | text | st.lists(text, max_size=4) | long_text,
        "stop_token_ids": st.none() | st.lists(odd_int, max_size=4),
        "n": st.integers(1, 3) | st.none(),
        "stream": st.booleans() | st.none(),
        "stream_options": st.none() | st.fixed_dictionaries({}, optional={
            "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, max_tokens + 2),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 1e30, exclude_min=True),
        "logit_bias": st.none() | valid_bias,
        "prompt_logprobs": st.none() | st.integers(0, 5),
        "user": text | long_text,
    }


def with_extras(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda b, extra, bad: {**extra, **bad, **b}, body, unknown_fields, refused)


prompts = (text | long_text | st.lists(text, max_size=3) | st.lists(token_id, max_size=12)
           | st.lists(odd_int, min_size=1, max_size=4)
           | st.lists(st.lists(token_id, max_size=6), max_size=3))
completion_bodies = with_extras(st.integers(1, 3).flatmap(lambda m: st.fixed_dictionaries(
    {"prompt": prompts, "max_tokens": st.just(m)},
    optional={**sampling(m), "logprobs": st.none() | st.integers(0, 5),
              "echo": st.booleans() | st.none()})))

content_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "input_text", "image_url", "audio"]) | text},
    optional={"text": st.none() | text, "image_url": json_values, "nested": deep})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | text},
    optional={"content": st.none() | text | long_text | st.lists(content_part, max_size=3),
              "name": text, "tool_calls": json_values, "extra": deep})
messages = st.lists(message, min_size=1, max_size=4)
template_kwargs = st.dictionaries(
    st.sampled_from(["enable_thinking", "tools", "documents", "tokenize", "return_dict",
                     "return_tensors", "chat_template", "truncation", "max_length", "padding",
                     "add_special_tokens", "continue_final_message"]) | text,
    finite_values | st.sampled_from(["pt", "np", "{{ 1/0 }}", "", "{{ messages[0] }}"]),
    max_size=2)


def chat_body(m: int) -> st.SearchStrategy[dict[str, Any]]:
    limit = st.sampled_from(["max_tokens", "max_completion_tokens"])
    fields = {**sampling(m), "logprobs": st.booleans() | st.none(),
              "top_logprobs": st.none() | st.integers(0, 5),
              "add_generation_prompt": st.booleans() | st.none(),
              "continue_final_message": st.booleans() | st.none(),
              "chat_template_kwargs": st.none() | template_kwargs,
              "echo": st.none() | st.just(False)}
    return st.builds(lambda name, b: {**b, name: m},
                     limit, st.fixed_dictionaries({"messages": messages}, optional=fields))


chat_bodies = with_extras(st.integers(1, 3).flatmap(chat_body))
tokenize_bodies = with_extras(st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, None, "gpt-9"]), "prompt": st.none() | text | long_text,
    "messages": st.none() | messages, "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans()}))
detokenize_bodies = with_extras(st.fixed_dictionaries(
    {"tokens": st.lists(token_id, max_size=12) | st.lists(odd_int, max_size=4)},
    optional={"model": st.sampled_from([MODEL, None, "gpt-9"])}))


# ---- malformed bodies --------------------------------------------------------------------------
@st.composite
def malformed(draw: st.DrawFn, bodies: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A well-formed body with one thing wrong: a field's value, a field gone, or no object."""
    body = draw(bodies)
    how = draw(st.sampled_from(["set", "set", "set", "drop", "not an object"]))
    if how == "not an object":
        return draw(json_values.filter(lambda v: not isinstance(v, dict)))
    droppable = sorted(set(body) - LIMITS)
    if how == "drop" and droppable:
        body.pop(draw(st.sampled_from(droppable)))
        return body
    name = draw(st.sampled_from(sorted(KNOWN | set(body))) | text)
    if name in COSTLY:
        body[name] = draw(refused_count | json_values.filter(lambda v: not _countable(v)))
    else:
        body[name] = draw(json_values | odd_bias | st.integers(-2, 22)
                          | st.sampled_from([[math.nan], {"a": math.inf}, "gpt-9", True]))
    return body


def _countable(value: Any) -> bool:
    """A value pydantic could read as a count or a prompt, which could be costly to serve."""
    return value is None or isinstance(value, bool | int | float | str | list)


RAW = [b"", b"{", b"{not json", b"NaN", b"Infinity", b"1e999999", b"[]", b"null", b'"x"',
       b"\xff\xfe\xfd", b"\xef\xbb\xbf{}", b'{"prompt": "a", "prompt": 5}',
       b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000]
raw_bodies = st.sampled_from(RAW) | st.binary(max_size=64) | st.builds(
    lambda b, cut: json.dumps(b).encode()[:cut], completion_bodies, st.integers(0, 40))
CONTENT_TYPES = [JSON, JSON, "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", None]


# ---- the checks --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[AsyncEngine]:
    """The app's engine (`tests/unit/conftest.py`'s `app` takes this one), on the tiny Llama."""
    eng = AsyncEngine(Engine(EngineConfig(model=tiny_llama, stream_interval_ms=0)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    """One event loop for every example (hypothesis drives plain functions)."""
    with asyncio.Runner() as r:
        yield r


def _strict(constant: str) -> Any:
    raise AssertionError(f"{constant} in a response body is not JSON")


def check_response(status: int, content_type: str, body: str, method: str = "POST") -> None:
    assert status < 500, f"{status}: {body[:2000]}"
    if status >= 400:
        if method == "HEAD":
            return
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        assert err["code"] == status and err["message"] and err["type"].endswith("Error"), body
    elif content_type.startswith("text/event-stream"):
        assert body.endswith("data: [DONE]\n\n"), body[-2000:]
        for event in body[:-2].split("\n\n")[:-1]:
            assert event.startswith("data: "), event
            error = json.loads(event[6:], parse_constant=_strict).get("error")
            assert error is None or error["code"] < 500, event
    elif content_type.startswith(JSON):
        json.loads(body, parse_constant=_strict)


async def send(app: FastAPI, path: str, content: bytes, content_type: str | None = JSON,
               method: str = "POST", params: dict[str, str] | None = None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    async with http(app) as c:
        r = await c.request(method, path, content=content, headers=headers, params=params)
    event(f"{method} {r.status_code}")  # pytest --hypothesis-show-statistics: the mix
    check_response(r.status_code, r.headers.get("content-type", ""), r.text, method)


def post(runner: asyncio.Runner, app: FastAPI, path: str, body: Any) -> None:
    runner.run(send(app, path, json.dumps(body).encode()))


@settings(FUZZ, max_examples=120)
@given(body=completion_bodies | malformed(completion_bodies))
def test_fuzz_completions(runner, app, body) -> None:
    post(runner, app, "/v1/completions", body)


@settings(FUZZ, max_examples=80)
@given(body=chat_bodies | malformed(chat_bodies))
def test_fuzz_chat_completions(runner, app, body) -> None:
    post(runner, app, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=100)
@given(path=st.sampled_from(["/tokenize", "/detokenize"]), data=st.data())
def test_fuzz_tokenize_and_detokenize(runner, app, path, data) -> None:
    bodies = tokenize_bodies if path == "/tokenize" else detokenize_bodies
    post(runner, app, path, data.draw(bodies | malformed(bodies)))


POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GETS = ["/v1/models", "/health", "/metrics"]


@settings(FUZZ, max_examples=80)
@given(path=st.sampled_from(POSTS), content=raw_bodies,
       content_type=st.sampled_from(CONTENT_TYPES))
def test_fuzz_raw_bodies(runner, app, path, content, content_type) -> None:
    runner.run(send(app, path, content, content_type))


@settings(FUZZ, max_examples=80)
@given(path=st.sampled_from(GETS + POSTS + ["/v1/models/" + MODEL, "/v1", "/", "/v1/../health"])
       | st.from_regex(r"/[A-Za-z0-9._~%/-]{0,20}", fullmatch=True),
       method=st.sampled_from(["GET", "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
       params=st.dictionaries(url_text, url_text, max_size=3), content=st.binary(max_size=16))
def test_fuzz_methods_paths_and_queries(runner, app, path, method, params, content) -> None:
    runner.run(send(app, path, content, JSON, method, params))


@pytest.mark.parametrize("ids", [[VOCAB], [-1], [2**70]], ids=["vocab", "negative", "huge"])
def test_stop_token_ids_outside_the_vocabulary_are_400(runner, app, ids) -> None:
    """Found by the fuzz: with min_tokens the engine bans the stop tokens by indexing the
    logits with them, so such an id failed the model step of the whole batch (500)."""

    async def ask() -> Any:
        async with http(app) as c:
            return await c.post("/v1/completions", json={
                "prompt": "Once upon a", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": ids})

    r = runner.run(ask())
    assert r.status_code == 400 and "stop_token_ids" in r.text, r.text


def test_healthy_after_the_fuzz(runner, app, engine: AsyncEngine) -> None:
    """Runs last in this module: /health is 200, a plain request is served, and once every
    request has ended the engine holds none and every page is free or in the prefix cache."""
    assert engine.engine.runner.model_config.vocab_size == VOCAB

    async def after() -> None:
        async with http(app) as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a",
                                                      "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        await engine.run(lambda: drain_and_check_released(engine.engine))
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == stats.kv_pages_pinned == 0

    runner.run(after())
