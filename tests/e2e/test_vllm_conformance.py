"""Conformance with vLLM's OpenAI server, through real Ray Serve and HTTP, in both serving modes
(the shared configs/local.yaml apps of both modes, SmolLM2 on CPU), and, for what depends on
vLLM's metric names and defaults, the shared disaggregated app under those names (`vllm_app`:
`metric_prefix: vllm`, no `prompt_tokens_details`): it serves both pools, so every metric family
is on its /metrics.

Each test pins a behaviour that vLLM's clients, harnesses and dashboards rely on, in the shapes of
vLLM's protocol: /metrics under `vllm:` names, label names and buckets (gauges back at 0 after an
abort); usage on every stream chunk with `continuous_usage_stats`; `model: ""`; the seed's signed
64-bit range and pydantic's error types in messages; the sampled token first in completions'
`top_logprobs`; `return_tokens_as_token_ids`; /tokenize's `token_strs` and an open final turn;
/version, /ping and /invocations; chat `echo` continuing an assistant turn;
`prompt_tokens_details` null by default; `service_tier` and `system_fingerprint` null on every
object; a chunk per token; text cut inside a character ending in U+FFFD; OpenAI's roles;
`iteration_tokens_total` as prompts plus generated tokens and `kv_cache_usage_perc` 0 when idle.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metric_names import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS
from tests.e2e.conftest import in_both_modes
from tests.e2e.test_serve_reliability import MODEL, TIMEOUT_S
from tests.waiting import wait_until
from workers.serve.stats_board import POST_INTERVAL_S

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_tokens": 6, "temperature": 0}
MAX_MODEL_LEN = 512  # local_args'


@pytest.fixture(scope="module")
def apps(local_apps: dict[str, str]) -> dict[str, str]:
    """Base URL of each mode's shared configs/local.yaml application."""
    return local_apps


def call(base: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(f"{base}/{path}", json=body, timeout=TIMEOUT_S)
    assert r.status_code == status, r.text
    return r.json()


def stream(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base}/v1/{path}", json={**body, "stream": True},
                      timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def families(base: str) -> dict[str, Any]:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def one_two_five(limit: int) -> list[float]:
    return [float(m * 10**e) for e in range(6) for m in (1, 2, 5) if m * 10**e <= limit]


# ---- 1. metrics ---------------------------------------------------------------------------------
VLLM_FAMILIES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
    "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_inference_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_params_n", "request_params_max_tokens", "cache_config_info",
    "iteration_tokens_total",
)


def bounds(family: Any) -> list[float]:
    les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
    return [float(le) for le in les if le != "+Inf"]


def test_metrics_carry_vllms_names_labels_and_buckets(vllm_app) -> None:
    base = vllm_app
    call(base, "v1/completions", {"prompt": "Once upon a time", "n": 2, **GREEDY})
    got = families(base)
    assert not [name for name in got if not name.startswith("vllm:")]
    assert {f"vllm:{name}" for name in VLLM_FAMILIES} <= got.keys()
    running = got["vllm:num_requests_running"].samples
    assert running and all(set(s.labels) == {"model_name", "engine"} for s in running)
    assert {s.labels["model_name"] for s in running} == {MODEL}
    assert bounds(got["vllm:time_to_first_token_seconds"]) == list(TTFT_BUCKETS)
    assert bounds(got["vllm:time_per_output_token_seconds"]) == list(ITL_BUCKETS)
    assert bounds(got["vllm:request_queue_time_seconds"]) == list(LATENCY_BUCKETS)
    assert bounds(got["vllm:request_params_n"]) == [1, 2, 5, 10, 20]
    assert bounds(got["vllm:request_params_max_tokens"]) == one_two_five(MAX_MODEL_LEN)
    n = {s.name: s.value for s in got["vllm:request_params_n"].samples if "le" not in s.labels}
    assert n["vllm:request_params_n_count"] >= 2 and n["vllm:request_params_n_sum"] >= 4
    reasons = {s.labels["finished_reason"] for s in got["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    steps = {s.name: s.value for s in got["vllm:iteration_tokens_total"].samples}
    assert steps["vllm:iteration_tokens_total_count"] > 0  # the engines count their steps
    info = got["vllm:cache_config_info"].samples
    assert info and all(s.value == 1 and s.labels["block_size"] == "16" for s in info)


def engine_values(base: str, name: str) -> list[float]:
    return [s.value for s in families(base)[name].samples if s.labels.get("engine") != "router"]


def settled(read: Callable[[], float]) -> float:
    """`read()` once two reads more than two stats posts apart agree."""
    seen = [read()]

    def agrees() -> bool:
        time.sleep(2.5 * POST_INTERVAL_S)
        seen.append(read())
        return seen[-1] == seen[-2]

    wait_until(agrees, TIMEOUT_S, interval_s=0.1, what="the engines' stats settled")
    return seen[-1]


def test_iteration_tokens_are_prompt_plus_generated_and_idle_kv_is_free(vllm_app) -> None:
    """vLLM's count per step: the whole prompt when its first token comes, then each generated
    token; over the prefill and decode engines of one request, prompt + max_tokens. Once it
    ended no page is held: the cached ones count as free."""
    base, body = vllm_app, {"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0,
                            "ignore_eos": True}
    prompt_tokens = len(call(base, "tokenize", {"prompt": body["prompt"]})["tokens"])

    def steps_sum() -> float:
        return sum(s.value for s in families(base)["vllm:iteration_tokens_total"].samples
                   if s.name.endswith("_sum"))

    before = settled(steps_sum)  # the earlier tests' steps all posted
    call(base, "v1/completions", body)
    wait_until(lambda: steps_sum() - before == prompt_tokens + 7, TIMEOUT_S, interval_s=0.2,
               what=f"{prompt_tokens} + 7 tokens in iteration_tokens_total")
    wait_until(lambda: not any(engine_values(base, "vllm:kv_cache_usage_perc")), TIMEOUT_S,
               interval_s=0.2, what="kv_cache_usage_perc back at 0 with the prompt cached")
    assert any(engine_values(base, "vllm:prefix_cache_queries"))


def gauges(base: str, prefix: str) -> list[float]:
    got = families(base)
    return [s.value for name in (f"{prefix}:num_requests_running", f"{prefix}:num_requests_waiting")
            for s in got[name].samples]  # fmt: skip


@pytest.mark.parametrize("app", ["vllm", "colocated"])
def test_gauges_return_to_zero_after_an_abort(apps, vllm_app, app) -> None:
    base, prefix = (vllm_app, "vllm") if app == "vllm" else (apps[app], "pdserve")
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()
        for _ in range(3):  # role chunk and two tokens: the request runs
            next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: any(gauges(base, prefix)), TIMEOUT_S, interval_s=0.2,
                   what="the running request in the gauges")
    # the client went away: the request is aborted on every worker
    wait_until(lambda: not any(gauges(base, prefix)), TIMEOUT_S, interval_s=0.2,
               what="the gauges back at 0 after the abort")


# ---- 2. usage on every chunk ------------------------------------------------------------------
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@in_both_modes
def test_continuous_usage_is_on_every_chunk_including_the_first(apps, mode, path) -> None:
    prompt = {"messages": CHAT} if path.startswith("chat") else {"prompt": "Once upon a time"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(apps[mode], path, {**prompt, **GREEDY, "stream_options": options})
    assert all(c["usage"] is not None for c in chunks)
    prompt_tokens = chunks[0]["usage"]["prompt_tokens"]
    if path.startswith("chat"):
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        first = {k: chunks[0]["usage"][k] for k in ("completion_tokens", "total_tokens")}
        assert first == {"completion_tokens": 0, "total_tokens": prompt_tokens}
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    plain = stream(apps[mode], path, {**prompt, **GREEDY})
    assert all("usage" not in c for c in plain)  # without stream_options: no usage at all


# ---- 3. model "" --------------------------------------------------------------------------------
@in_both_modes
def test_an_empty_model_name_serves_the_model(apps, mode) -> None:
    r = call(apps[mode], "v1/chat/completions", {"model": "", "messages": CHAT, **GREEDY})
    assert r["model"] == MODEL
    r = call(apps[mode], "v1/completions", {"model": "", "prompt": "Hi", **GREEDY})
    assert r["model"] == MODEL


# ---- 4. validation ------------------------------------------------------------------------------
@in_both_modes
def test_seed_range_and_error_types_are_vllms(apps, mode) -> None:
    base = apps[mode]
    for seed in (2**63 - 1, -(2**63)):
        call(base, "v1/completions", {"prompt": "Hi", "seed": seed, **GREEDY})
    err = call(base, "v1/completions", {"prompt": "Hi", **GREEDY, "seed": 2**63}, 400)["error"]
    assert "less_than_equal" in err["message"] and err["param"] == "seed"
    err = call(base, "v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": -1},
               400)["error"]
    assert "greater_than_equal" in err["message"] and err["type"] == "BadRequestError"


# ---- 5. logprobs --------------------------------------------------------------------------------
@in_both_modes
def test_completion_top_logprobs_put_the_sampled_token_first(apps, mode) -> None:
    body = {"prompt": "Once upon a time", "logprobs": 3, "max_tokens": 6, "temperature": 1.0,
            "seed": 3}
    lp = call(apps[mode], "v1/completions", body)["choices"][0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        assert next(iter(top.items())) == (token, logprob)
        rest = list(top.values())[1:]
        assert 3 <= len(top) <= 4 and rest == sorted(rest, reverse=True)


@in_both_modes
def test_tokens_as_token_ids(apps, mode) -> None:
    base, as_id = apps[mode], re.compile(r"token_id:\d+")
    body = {"prompt": "Once upon a time", "logprobs": 2, "return_tokens_as_token_ids": True,
            **GREEDY}
    lp = call(base, "v1/completions", body)["choices"][0]["logprobs"]
    assert all(as_id.fullmatch(t) for t in lp["tokens"])
    assert all(as_id.fullmatch(t) for top in lp["top_logprobs"] for t in top)
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True, **GREEDY}
    content = call(base, "v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    for entry in [*content, *(t for c in content for t in c["top_logprobs"])]:
        assert as_id.fullmatch(entry["token"]) and bytes(entry["bytes"]) == entry["token"].encode()


# ---- 6. /tokenize -------------------------------------------------------------------------------
@in_both_modes
def test_tokenize_returns_token_strs_when_asked(apps, mode) -> None:
    base = apps[mode]
    plain = call(base, "tokenize", {"prompt": "Hello world"})
    assert "token_strs" in plain and plain["token_strs"] is None
    asked = call(base, "tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert asked["tokens"] == plain["tokens"] and len(asked["token_strs"]) == asked["count"]
    assert asked["token_strs"][-1] == "Ġworld"  # the tokenizer's pieces, not decoded text


@in_both_modes
def test_tokenize_leaves_a_continued_turn_open(apps, mode) -> None:
    """The tokens the chat would run: with continue_final_message the last turn has no end
    token (vLLM's), and its count is the chat's prompt_tokens."""
    base, start = apps[mode], "The capital of France is"
    body = {"messages": [*CHAT, {"role": "assistant", "content": start}],
            "add_generation_prompt": False, "continue_final_message": True}
    open_turn = call(base, "tokenize", {**body, "return_token_strs": True})
    closed = call(base, "tokenize", {**body, "continue_final_message": False})
    assert closed["tokens"][: open_turn["count"]] == open_turn["tokens"]
    assert closed["count"] > open_turn["count"] and "<|im_end|>" not in open_turn["token_strs"][-3:]
    assert open_turn["token_strs"][-1] == "Ġis"
    usage = call(base, "v1/chat/completions", {**body, **GREEDY})["usage"]
    assert usage["prompt_tokens"] == open_turn["count"]
    both = call(base, "tokenize", {**body, "add_generation_prompt": True}, 400)["error"]
    assert both["param"] == "continue_final_message"


# ---- 7. endpoints -------------------------------------------------------------------------------
@in_both_modes
def test_version_ping_and_invocations(apps, mode) -> None:
    base = apps[mode]
    version = httpx.get(f"{base}/version", timeout=TIMEOUT_S)
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    assert httpx.get(f"{base}/ping", timeout=TIMEOUT_S).status_code == 200
    assert httpx.post(f"{base}/ping", timeout=TIMEOUT_S).status_code == 200
    chat = call(base, "invocations", {"messages": CHAT, **GREEDY})
    assert chat["object"] == "chat.completion"
    text = call(base, "invocations", {"prompt": "Once upon a time", **GREEDY})
    assert text["object"] == "text_completion"
    err = call(base, "invocations", {"max_tokens": 3}, 400)["error"]
    assert "Cannot find suitable handler" in err["message"]


# ---- 8. chat echo -------------------------------------------------------------------------------
@in_both_modes
def test_chat_echo_continues_an_assistant_turn(apps, mode) -> None:
    base = apps[mode]
    start = "The capital of France is"
    body = {"messages": [*CHAT, {"role": "assistant", "content": start}], **GREEDY,
            "add_generation_prompt": False, "continue_final_message": True}
    reply = call(base, "v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = call(base, "v1/chat/completions", {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == start + reply and reply
    chunks = stream(base, "chat/completions", {**body, "echo": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == start + reply
    # with a generation prompt, the reply is a new assistant turn: nothing is echoed
    fresh = call(base, "v1/chat/completions", {"messages": CHAT, **GREEDY, "echo": True})
    plain = call(base, "v1/chat/completions", {"messages": CHAT, **GREEDY})
    assert fresh["choices"][0]["message"] == plain["choices"][0]["message"]


# ---- 9. prompt_tokens_details -------------------------------------------------------------------
def test_prompt_tokens_details_is_null_by_default(vllm_app) -> None:
    body = {"messages": CHAT * 20, **GREEDY}  # long enough to be cached on the second call
    for _ in range(2):
        usage = call(vllm_app, "v1/chat/completions", body)["usage"]
        assert "prompt_tokens_details" in usage and usage["prompt_tokens_details"] is None


# ---- 10. response objects -----------------------------------------------------------------------
@in_both_modes
def test_every_object_carries_service_tier_and_fingerprint_null(apps, mode) -> None:
    base = apps[mode]
    objects = [call(base, "v1/chat/completions", {"messages": CHAT, **GREEDY}),
               call(base, "v1/completions", {"prompt": "Hi", **GREEDY}),
               *stream(base, "chat/completions", {"messages": CHAT, **GREEDY}),
               *stream(base, "completions", {"prompt": "Hi", **GREEDY})]
    for o in objects:
        assert o["service_tier"] is None and o["system_fingerprint"] is None, o


# ---- 11. streaming and text ---------------------------------------------------------------------
@in_both_modes
def test_a_stream_sends_a_chunk_per_token(apps, mode) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    chunks = stream(apps[mode], "completions", body)
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks] == [1] * 12


@in_both_modes
def test_an_answer_cut_inside_a_character_ends_in_a_replacement_char(apps, mode) -> None:
    """Token 10813 is the first two bytes of 🚀: cut after it (max_tokens 1), the text is the
    token decoded, U+FFFD, as vLLM's, not an empty string."""
    body = {"messages": CHAT, "max_tokens": 1, "temperature": 0, "logit_bias": {"10813": 100}}
    whole = call(apps[mode], "v1/chat/completions", body)["choices"][0]
    assert whole["message"]["content"] == "\ufffd" and whole["finish_reason"] == "length"
    chunks = stream(apps[mode], "chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "\ufffd"
    text = call(apps[mode], "v1/completions",
                {"prompt": "Hi", **{k: v for k, v in body.items() if k != "messages"}})
    assert text["choices"][0]["text"] == "\ufffd"


# ---- 12. validation of messages and bodies ------------------------------------------------------
@in_both_modes
def test_a_role_outside_openais_and_broken_json_are_400(apps, mode) -> None:
    base = apps[mode]
    wizard = {"messages": [{"role": "wizard", "content": "Hi"}], **GREEDY}
    err = call(base, "v1/chat/completions", wizard, 400)["error"]
    assert err["param"] == "messages" and "wizard" in err["message"]
    r = httpx.post(f"{base}/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and "not valid JSON" in err["message"]
