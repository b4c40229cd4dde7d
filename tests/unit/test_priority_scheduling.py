"""vLLM's priority scheduling (`EngineConfig.scheduling_policy`): under `priority` the engine
admits requests by priority (lower first), then arrival, and preempts the lowest-priority
running sequence first; under the default `fcfs` a request with a priority is refused (a 400
over HTTP: tests/unit/test_openai_api.py)."""

from __future__ import annotations

import pytest

from workers import LLM
from workers.engine.admission import RequestRejectedError
from workers.protocol import GenerateRequest, SamplingParams
from workers.scheduler.waiting import WaitingQueue
from workers.sequence import Sequence

PROMPT = (1, 504, 3458, 282, 4649, 314, 253, 2533)  # 8 tokens: two pages of 4


def _seq(name: str, priority: int, arrival: float) -> Sequence:
    return Sequence(request_id=name, token_ids=[1], num_prompt_tokens=1,
                    params=SamplingParams(), detokenizer=None, arrival_time=arrival,
                    priority=priority)  # fmt: skip


def test_the_queue_orders_by_priority_then_arrival_and_fcfs_by_arrival() -> None:
    seqs = [_seq("a", 2, 0.0), _seq("b", 0, 1.0), _seq("c", 2, 2.0), _seq("d", 1, 3.0)]
    by_priority, fcfs = WaitingQueue("priority"), WaitingQueue("fcfs")
    for s in seqs:
        by_priority.push(s)
        fcfs.push(s)
    assert [s.request_id for s in by_priority] == ["b", "d", "a", "c"]
    assert [s.request_id for s in fcfs] == ["a", "b", "c", "d"]
    head = by_priority.pop_head()
    by_priority.push_back(head)  # preempted: back to its place, the head again
    assert by_priority.head() is head
    fcfs.push_back(seqs[3])
    assert fcfs.head() is seqs[3] and len(fcfs) == 5


def _finish_order(
    llm: LLM, priorities: dict[str, int], max_tokens: int, steps_between: int = 0
) -> list[str]:
    """The requests' names in the order they finish, added in `priorities`' order with
    `steps_between` engine steps after each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    order = []
    for name, priority in priorities.items():
        llm.engine.add_request(GenerateRequest(request_id=name, prompt_token_ids=PROMPT,
                                               params=params, priority=priority))  # fmt: skip
        for _ in range(steps_between):
            order += [out.request_id for out in llm.engine.step() if out.finished]
    while llm.engine.has_work():
        order += [out.request_id for out in llm.engine.step() if out.finished]
    return order


def test_one_seat_serves_the_lowest_priority_value_first() -> None:
    llm = LLM(scheduling_policy="priority", max_num_seqs=1, num_kv_pages=32, page_size=4)
    assert _finish_order(llm, {"a": 3, "b": 1, "c": 2, "d": 1}, 2) == ["b", "d", "c", "a"]
    fcfs = LLM(max_num_seqs=1, num_kv_pages=32, page_size=4)
    assert _finish_order(fcfs, {"a": 0, "b": 0, "c": 0}, 2) == ["a", "b", "c"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_lowest_priority_not_the_newest(policy: str) -> None:
    """Two sequences that cannot both finish in the pool (8 pages each, 12 usable), "lo"
    running before "hi" arrives: fcfs preempts the newer, "hi", so "lo" finishes first;
    priority preempts "lo"."""
    llm = LLM(scheduling_policy=policy, max_num_seqs=2, num_kv_pages=13, page_size=4,
              enable_prefix_caching=False)  # fmt: skip
    lo_first = {"lo": 5 if policy == "priority" else 0, "hi": 0}
    order = _finish_order(llm, lo_first, 24, steps_between=2)
    assert llm.engine.scheduler.num_preemptions >= 1
    assert order == (["hi", "lo"] if policy == "priority" else ["lo", "hi"])


def test_fcfs_refuses_a_priority_as_vllm_does() -> None:
    llm = LLM(max_num_seqs=1, num_kv_pages=32, page_size=4)
    req = GenerateRequest(request_id="p", prompt_token_ids=PROMPT, priority=1)
    with pytest.raises(RequestRejectedError, match="priority scheduling is not enabled"):
        llm.engine.add_request(req)
    with pytest.raises(RequestRejectedError, match="priority"):
        llm.generate([list(PROMPT)], SamplingParams(max_tokens=1), priority=[2])
    out = llm.generate([list(PROMPT)], SamplingParams(max_tokens=1), priority=[0])
    assert len(out[0].token_ids) == 1
