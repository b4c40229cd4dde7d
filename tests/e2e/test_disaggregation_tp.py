"""Tensor-parallel hand-off over real NIXL (UCX, DRAM); ranks are Ray actors talking gloo.

Prefill TP=2 -> decode TP=2: each decode rank reads its own KV heads from the prefill rank of the
same index. Heterogeneous TP, both ways: TP=1 -> TP=2 (each decode rank reads the one prefill
rank's pages and keeps its head) and TP=2 -> TP=1 (the decode rank reads both prefill ranks).
The random tiny Llama (4 query heads, 2 KV heads) splits over 2 ranks, one KV head each: a head
not read, or put in the wrong place, would decode from garbage and change the tokens.
"""

from __future__ import annotations

import time

import pytest
import ray

from tests.waiting import wait_until
from workers import LLM
from workers.engine_stats import EngineStats
from workers.protocol import GenerateRequest, KVHandle, RequestOutput, SamplingParams
from workers.serve.decode import DecodeWorker
from workers.serve.prefill import PrefillWorker

pytestmark = pytest.mark.e2e

TINY = {"num_kv_pages": 64, "page_size": 4, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
]
DEADLINE_S = 30.0


class Prefill(PrefillWorker):
    holding = False

    async def pause(self, seconds: float) -> None:
        """Hold the engine loop: no rank's agent progresses meanwhile (the sleep is the hold)."""

        def hold() -> None:
            self.holding = True
            try:
                time.sleep(seconds)
            finally:
                self.holding = False

        await self.loop.run(hold)

    async def is_holding(self) -> bool:
        return self.holding


class Decode(DecodeWorker):
    async def run(self, req: GenerateRequest, first: RequestOutput) -> list[RequestOutput]:
        return [chunk async for chunk in self.generate(req, first)]

    async def abort_while_reading(
        self, req: GenerateRequest, first: RequestOutput
    ) -> tuple[bool, EngineStats]:
        """Admit, post the reads on every rank, abort; whether a rank's read was in flight,
        and the stats right after the abort."""
        engine = self.engine

        def admit_post_abort() -> tuple[bool, EngineStats]:
            engine.add_remote(req, first)
            engine.poll()  # rank 0 posts its read, then ranks 1..N-1 theirs (one round)
            [p] = engine.pending
            assert p.read is not None and p.group_read is not None and engine.group is not None
            states = [h.state for h in p.read.handles] + [engine.group.state(p.group_read)]
            in_flight = "PROC" in states
            engine.abort(req.request_id)
            return in_flight, engine.stats()

        return await self.loop.run(admit_post_abort)


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_llama: str):  # noqa: ANN201
    # Both at once: each starts its rank-1 actor and joins its own gloo group.
    prefill = ray.remote(num_cpus=1)(Prefill)
    decode = ray.remote(num_cpus=1)(Decode)
    engine = {"model": tiny_llama, "tensor_parallel_size": 2, **TINY}
    p = prefill.remote(engine, {"lease_s": 30.0})
    d = decode.remote(engine, {"lease_s": 30.0})
    ray.get([p.__ray_ready__.remote(), d.__ray_ready__.remote()])
    yield p, d
    ray.kill(p)
    ray.kill(d)


@pytest.fixture(scope="module")
def singles(ray_cluster, tiny_llama: str):  # noqa: ANN201
    """A TP=1 prefill and a TP=1 decode replica, to pair with the TP=2 ones."""
    engine = {"model": tiny_llama, "tensor_parallel_size": 1, **TINY}
    p = ray.remote(num_cpus=1)(Prefill).remote(engine, {"lease_s": 30.0})
    d = ray.remote(num_cpus=1)(Decode).remote(engine, {"lease_s": 30.0})
    ray.get([p.__ray_ready__.remote(), d.__ray_ready__.remote()])
    yield p, d
    ray.kill(p)
    ray.kill(d)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, **TINY)


def request(llm: LLM, rid: str, text: str) -> GenerateRequest:
    ids = llm.tokenizer.encode(text)
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, params=GREEDY)


@pytest.mark.parametrize("prefill_tp", [2, 1])
def test_an_abort_mid_read_keeps_pages_until_every_rank_read_ends(
    llm, pair, singles, prefill_tp: int
) -> None:
    prefill, decode = (pair if prefill_tp == 2 else singles)[0], pair[1]
    req = request(llm, f"abort-mid-read-{prefill_tp}", PROMPTS[1])
    first = ray.get(prefill.prefill.remote(req))
    assert first.kv is not None and len(first.kv.agent_names) == prefill_tp
    assert [lay.kv_head_offset for lay in first.kv.layout] == [0, 1][:prefill_tp]
    # A reader's first READ waits for the owner's side of the UCX wire-up: with the prefill
    # loop held, neither prefill rank calls in, so the reads stay in flight.
    paused = prefill.pause.remote(1.5)
    wait_until(lambda: ray.get(prefill.is_holding.remote()), 10, what="the prefill loop held")
    in_flight, held = ray.get(decode.abort_while_reading.remote(req, first))
    assert in_flight
    assert held.num_handoffs_pending == 1 and held.kv_pages_used > 0  # pages kept while read
    ray.get(paused)
    wait_until(
        lambda: ray.get(decode.stats.remote()).num_handoffs_pending == 0,
        DEADLINE_S,
        what="reads to end",
    )
    d = ray.get(decode.stats.remote())
    assert d.kv_pages_used == 0 and d.kv_pages_pinned == 0 and d.num_running == 0  # spares too
    ray.get(prefill.release.remote(first.kv.agent_names[0], first.kv.lease_id))  # as the router
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0,
        DEADLINE_S,
        what="prefill unpin",
    )


def hand_off(llm: LLM, prefill, decode, name: str) -> tuple[EngineStats, EngineStats, KVHandle]:  # noqa: ANN001
    """Every prompt prefilled by `prefill` and decoded by `decode` gives the single-process
    engine's tokens and leaves no page held on either side (staging pages included); the decode
    side's stats before and after, and a KV handle."""
    reqs = [request(llm, f"{name}{i}", text) for i, text in enumerate(PROMPTS)]
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    before = ray.get(decode.stats.remote())
    firsts = ray.get([prefill.prefill.remote(r) for r in reqs])
    rests = ray.get([decode.run.remote(r, f) for r, f in zip(reqs, firsts)], timeout=DEADLINE_S)
    got = [f.token_ids + [t for c in rest for t in c.token_ids] for f, rest in zip(firsts, rests)]
    assert got == expected
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0,
        DEADLINE_S,
        what="prefill unpin",
    )
    after = ray.get(decode.stats.remote())
    assert after.num_handoffs_pending == 0 and after.num_running == 0
    assert after.kv_pages_pinned == 0 and after.kv_pages_used == after.kv_pages_cached
    assert after.num_recomputed == before.num_recomputed  # every read was DONE and fresh
    assert firsts[0].kv is not None
    return before, after, firsts[0].kv


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "reads_per_page"),
    [(2, 2, 1), (1, 2, 2), (2, 1, 1)],  # TP 1 -> 2: both decode ranks read each (whole) page
)
def test_a_tp_hand_off_gives_the_single_process_tokens(
    llm, pair, singles, prefill_tp: int, decode_tp: int, reads_per_page: int
) -> None:
    prefill = (pair if prefill_tp == 2 else singles)[0]
    decode = (pair if decode_tp == 2 else singles)[1]
    for again in (False, True):  # again: the decode side caches the prompts' whole pages
        before, after, kv = hand_off(llm, prefill, decode, f"p{prefill_tp}d{decode_tp}-{again}-")
        pages = after.kv_pages_read - before.kv_pages_read
        assert pages > 0 and len(kv.agent_names) == prefill_tp
        if again:  # only the pages after the cached ones are read
            assert after.kv_pages_reused > before.kv_pages_reused
        # every decode rank reads the whole pages of each prefill rank holding some of its heads
        moved = after.nixl_bytes_transferred - before.nixl_bytes_transferred
        assert moved == reads_per_page * pages * sum(layout.page_bytes for layout in kv.layout)
