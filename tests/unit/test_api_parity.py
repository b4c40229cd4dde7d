"""vLLM's shapes without a server: metric naming and buckets, the request timer's phases, the
engines' tokens per step and KV usage as vLLM counts them, the completions top_logprobs order,
token ids as names, chat echo and validation messages, fields on every response object."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from router.backend import RoleStats
from router.errors import BadRequestError, error_text
from router.generation import chat_echo
from router.metric_names import Naming, one_two_five
from router.metrics import Metrics
from router.params import check_supported
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.responses import sampled_then_top
from tests.unit.test_router_metrics import stats
from workers import LLM, SamplingParams
from workers.api import TokenLogprob
from workers.engine.step_tokens import StepTokens


def test_one_two_five_buckets_stop_at_the_limit() -> None:
    assert one_two_five(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert one_two_five(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_vllm_naming_renames_every_family_and_the_role_label() -> None:
    metrics = Metrics("m", naming=Naming("vllm"), max_model_len=100,
                      cache_info={"block_size": "16"})
    timer = metrics.request_timer(prompt_tokens=7, n=2, max_tokens=30)
    timer.on_tokens(1)
    timer.on_tokens(2)
    timer.finish("stop")
    text = metrics.render([RoleStats("decode", stats(1, 2, 0, 5))]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("vllm:") for name in families)
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "m", "engine": "decode"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["num_gpu_blocks"] == "100" and info.labels["block_size"] == "16"
    values = {s.name: s.value for f in families.values() for s in f.samples
              if "le" not in s.labels and s.labels.get("engine") == "router"}
    assert values["vllm:request_prompt_tokens_sum"] == 7
    assert values["vllm:request_generation_tokens_sum"] == 3
    assert values["vllm:request_params_n_sum"] == 2
    assert values["vllm:request_params_max_tokens_sum"] == 30
    assert values["vllm:time_per_output_token_seconds_count"] == 1
    for phase in ("queue", "prefill", "decode", "inference"):
        assert values[f"vllm:request_{phase}_time_seconds_count"] == 1
    les = [s.labels["le"] for s in families["vllm:request_params_max_tokens"].samples
           if "le" in s.labels]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_tokens_per_step_render_as_vllms_iteration_tokens_histogram() -> None:
    steps = StepTokens()
    for n in (1, 8, 9, 20000):
        steps.observe(n)
    assert steps.buckets[:3] == [1, 2, 3] and steps.buckets[-2:] == [3, 4]
    posted = stats(1, 2, 0, 5).model_copy(
        update={"iteration_tokens": steps.buckets, "iteration_tokens_sum": steps.sum})
    metrics = Metrics("m", naming=Naming("vllm"))
    text = metrics.render([RoleStats("decode", posted), RoleStats("decode", posted)]).decode()
    assert 'vllm:iteration_tokens_total_bucket{engine="decode",le="8.0",model_name="m"} 4.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="decode",model_name="m"} 8.0' in text
    assert 'vllm:iteration_tokens_total_sum{engine="decode",model_name="m"} 40036.0' in text


def test_tokens_per_step_are_prompts_and_generated_tokens_as_vllm_counts_them() -> None:
    """10 requests of 9 prompt tokens and 10 generated: 190 tokens over the steps, as vLLM's
    iteration_tokens_total, with prompts split into chunks (the budget is 16 tokens a step);
    after them no page is held, so kv_cache_usage_perc is 0 with the prompts still cached."""
    llm = LLM(max_num_batched_tokens=16, page_size=4)
    prompts = [list(range(100 + 10 * i, 109 + 10 * i)) for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [10] * 10
    steps = llm.engine.step_tokens
    assert steps.sum == 10 * 9 + 10 * 10
    assert steps.buckets[-1] >= 10  # one observation per step that produced tokens
    posted = llm.engine.stats()
    assert posted.kv_pages_used > 0 and posted.kv_pages_evictable == posted.kv_pages_used
    text = Metrics("m", naming=Naming("vllm")).render([RoleStats("colocated", posted)]).decode()
    assert 'vllm:kv_cache_usage_perc{engine="colocated",model_name="m"} 0.0' in text


def test_offline_truncate_prompt_tokens_runs_the_prompts_last_tokens() -> None:
    """`SamplingParams(truncate_prompt_tokens=k)` offline, as vLLM's: the request's prompt is
    the last k tokens, and its tokens are those of sending them; more than the context is a
    ValueError naming the limit."""
    llm = LLM(num_kv_pages=64)
    ids = list(range(200, 240))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cut, sent = llm.generate([ids, ids[-6:]], [params.model_copy(
        update={"truncate_prompt_tokens": 6}), params])  # fmt: skip
    assert cut.prompt_token_ids == ids[-6:] and cut.token_ids == sent.token_ids
    too_many = params.model_copy(update={"truncate_prompt_tokens": llm.engine.max_model_len + 1})
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([ids], too_many)


def test_kv_usage_counts_only_pages_requests_hold() -> None:
    held = stats(1, 30, 0, 5).model_copy(update={"kv_pages_evictable": 20})
    text = Metrics("m").render([RoleStats("decode", held)]).decode()
    assert 'pdserve:kv_cache_usage_perc{model_name="m",role="decode"} 0.1' in text


def test_the_sampled_token_comes_first_then_the_top_ones_best_first() -> None:
    t = TokenLogprob(token_id=5, logprob=-2.0, top={1: -0.5, 5: -2.0, 3: -0.1})
    assert sampled_then_top(t) == [(5, -2.0), (3, -0.1), (1, -0.5)]


def test_chat_echo_is_the_last_message_when_the_reply_continues_it() -> None:
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    cont = ChatCompletionRequest(messages=turn, echo=True, add_generation_prompt=False,
                                 continue_final_message=True)
    assert chat_echo(cont) == "Hel"
    user_last = ChatCompletionRequest(messages=turn[:1], echo=True)
    assert chat_echo(user_last) == ""  # a new assistant turn: nothing to echo
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert chat_echo(ChatCompletionRequest(messages=parts, add_generation_prompt=False)) == "a\nb"


def test_validation_messages_carry_pydantics_error_type() -> None:
    try:
        CompletionRequest(prompt="x", seed=2**63)
    except ValidationError as e:
        text = error_text(e.errors()[0])
    assert "[type=less_than_equal, input_value=9223372036854775808, input_type=int]" in text
    CompletionRequest(prompt="x", seed=2**63 - 1)
    CompletionRequest(prompt="x", seed=-(2**63))


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("length_penalty", 0.5),
                                          ("best_of", 3)])
def test_beam_search_is_a_400_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(BadRequestError) as e:
        check_supported(CompletionRequest(prompt="x", **{field: value}))
    assert e.value.status == 400 and e.value.param == field
    check_supported(CompletionRequest(prompt="x", use_beam_search=False, length_penalty=1.0,
                                      best_of=1))  # neutral values pass
