"""Prefill and decode in separate Ray actors, KV pages handed over by real NIXL (UCX, DRAM)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.waiting import wait_until
from workers import LLM
from workers.protocol import GenerateRequest, RequestOutput, SamplingParams
from workers.serve.decode import DecodeWorker
from workers.serve.prefill import PrefillWorker

pytestmark = pytest.mark.e2e

ENGINE = {"page_size": 16, "kv_cache_memory_gb": 0.25}
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 10
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
DEADLINE_S = 30.0


class Prefill(PrefillWorker):
    async def stale(self, lease_id: str) -> None:
        """Free a handed-off prompt's pages and scribble over them, as reuse would."""

        def reuse() -> None:
            lease = self.engine.leases.pop(lease_id)
            assert lease is not None
            pages = list(lease.seq.pages)
            self.engine.kv.release(lease.seq, cache=False)
            assert self.engine.kv.radix is not None
            self.engine.kv.radix.evict(self.engine.allocator.num_usable)
            self.engine.runner.pool.pages[pages] = 7.0

        await self.loop.run(reuse)


class Decode(DecodeWorker):
    async def run(self, req: GenerateRequest, first: RequestOutput) -> list[RequestOutput]:
        return [chunk async for chunk in self.generate(req, first)]

    async def abort_after(self, req: GenerateRequest, first: RequestOutput, n: int) -> int:
        got = 0
        stream = self.generate(req, first)
        async for chunk in stream:
            got += len(chunk.token_ids)
            if got >= n:
                break
        await stream.aclose()
        return got


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> Iterator[list]:
    """The shared Ray cluster; the actors the module starts in it die when the module ends."""
    actors: list = []
    yield actors
    for actor in actors:
        ray.kill(actor)


def start(cluster: list, cls, engine: dict = ENGINE, **transfer):  # noqa: ANN001, ANN201
    actor = ray.remote(num_cpus=1)(cls).remote(engine, {"lease_s": 30.0, **transfer})
    ray.get(actor.__ray_ready__.remote())
    cluster.append(actor)
    return actor


@pytest.fixture(scope="module")
def prefill(cluster):
    return start(cluster, Prefill)


@pytest.fixture(scope="module")
def decode(cluster):
    # Overlap scheduling, as on GPUs: the decode loop launches step n+1 before reading step n.
    return start(cluster, Decode, {**ENGINE, "overlap_scheduling": True})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def request(llm: LLM, rid: str, text: str, params: SamplingParams = GREEDY) -> GenerateRequest:
    ids = llm.tokenizer.encode(text)
    return GenerateRequest(request_id=rid, prompt_token_ids=ids, params=params)


def tokens(first: RequestOutput, rest: list[RequestOutput]) -> list[int]:
    return first.token_ids + [t for c in rest for t in c.token_ids]


def test_split_prefill_and_decode_equal_the_single_process_engine(llm, prefill, decode) -> None:
    reqs = [
        request(llm, f"eq{i}", f"Question {i}: name a colour that starts with {c}.")
        for i, c in enumerate("BGRY")
    ]
    expected = [o.token_ids for o in llm.generate([list(r.prompt_token_ids) for r in reqs], GREEDY)]
    firsts = ray.get([prefill.prefill.remote(r) for r in reqs])
    assert all(f.kv is not None and len(f.token_ids) == 1 for f in firsts)
    rests = ray.get([decode.run.remote(r, f) for r, f in zip(reqs, firsts)])
    assert [tokens(f, r) for f, r in zip(firsts, rests)] == expected
    assert rests[0][-1].finish_reason == "length"
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0,
        DEADLINE_S,
        what="prefill unpin",
    )
    stats = ray.get(decode.stats.remote())
    assert stats.kv_pages_pinned == 0 and stats.num_recomputed == 0
    assert stats.nixl_bytes_transferred > 0


def test_logprobs_cover_every_token_across_the_hand_off(llm, prefill, decode) -> None:
    """Sampled tokens' logprobs from both sides; the prompt's come with the prefill side's first
    chunk, as the single-process engine computes them."""
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    req = request(llm, "logprobs", "The capital of France is", params)
    first = ray.get(prefill.prefill.remote(req))
    rest = ray.get(decode.run.remote(req, first))
    chunks = [first, *rest]
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in chunks)
    for c in chunks:
        for t, lp in zip(c.token_ids, c.logprobs or []):
            assert lp.token_id == t and len(lp.top) == 2 and max(lp.top, key=lp.top.get) == t
    [local] = llm.generate([list(req.prompt_token_ids)], params)
    assert first.prompt_logprobs is not None and local.prompt_logprobs is not None
    assert len(first.prompt_logprobs) == len(req.prompt_token_ids)
    assert [lp and lp.token_id for lp in first.prompt_logprobs] == [
        lp and lp.token_id for lp in local.prompt_logprobs
    ]
    assert all(c.prompt_logprobs is None for c in rest)


def test_second_request_with_shared_prefix_reads_only_new_pages(llm, prefill, decode) -> None:
    before = ray.get(decode.stats.remote())
    page_bytes = None
    reads = []
    for i in range(2):
        req = request(llm, f"shared{i}", SYSTEM + f"Question {i}: what is {i} + {i}?")
        first = ray.get(prefill.prefill.remote(req))
        page_bytes = first.kv.layout[0].page_bytes
        ray.get(decode.run.remote(req, first))
        after = ray.get(decode.stats.remote())
        reads.append(
            (
                after.kv_pages_read - before.kv_pages_read,
                after.nixl_bytes_transferred - before.nixl_bytes_transferred,
            )
        )
        before = after
    shared_pages = len(llm.tokenizer.encode(SYSTEM)) // 16
    assert reads[0][0] >= shared_pages
    assert reads[1][0] <= reads[0][0] - shared_pages + 1
    assert reads[1][1] == reads[1][0] * page_bytes  # bytes counted match pages read


def test_abort_on_decode_unpins_prefill_and_frees_decode_pages(llm, prefill, decode) -> None:
    req = request(
        llm,
        "aborted",
        "Tell me a long story about the sea.",
        SamplingParams(max_tokens=500, ignore_eos=True),
    )
    first = ray.get(prefill.prefill.remote(req))
    assert ray.get(decode.abort_after.remote(req, first, 3)) >= 3
    wait_until(
        lambda: ray.get(decode.stats.remote()).num_running == 0, DEADLINE_S, what="decode abort"
    )
    d = ray.get(decode.stats.remote())
    assert d.kv_pages_pinned == 0 and d.kv_pages_used == d.kv_pages_cached
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0,
        DEADLINE_S,
        what="prefill unpin",
    )


@pytest.fixture(scope="module")
def short_lease(cluster):
    """A second prefill replica, whose leases last 1 s."""
    return start(cluster, Prefill, lease_s=1.0)


def test_unread_pages_are_unpinned_when_the_lease_expires(llm, short_lease) -> None:
    short = short_lease
    first = ray.get(short.prefill.remote(request(llm, "unread", SYSTEM + "Hello?")))
    assert ray.get(short.stats.remote()).kv_pages_pinned > 0
    wait_until(
        lambda: ray.get(short.stats.remote()).kv_pages_pinned == 0, DEADLINE_S, what="lease expiry"
    )
    assert first.kv is not None and first.kv.lease_expiry < time.time()


def test_any_prefill_replica_can_release_another_ones_lease(llm, prefill, short_lease) -> None:
    first = ray.get(prefill.prefill.remote(request(llm, "released", SYSTEM + "Bye?")))
    assert ray.get(prefill.stats.remote()).kv_pages_pinned > 0
    ray.get(short_lease.release.remote(first.kv.agent_names[0], first.kv.lease_id))
    # Well inside the 30 s lease: the notification, not the expiry, unpinned it.
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0, 10, what="remote release"
    )


@pytest.fixture(scope="module")
def orphaned(llm, cluster) -> dict[str, Any]:  # noqa: ANN001
    """Two prompts prefilled by a prefill replica killed before any read (their hand-offs name
    pages nobody can serve), and a decode replica whose failure policy is "fail"."""
    strict = start(cluster, Decode, failure_policy="fail")
    doomed = start(cluster, Prefill)
    prompts = {"orphan": "Question: what colour is the sky on a clear day?",
               "strict": "Question: what is two plus two?"}  # fmt: skip
    reqs = {rid: request(llm, rid, text) for rid, text in prompts.items()}
    firsts = {rid: ray.get(doomed.prefill.remote(req)) for rid, req in reqs.items()}
    ray.kill(doomed)
    return {"requests": reqs, "firsts": firsts, "strict": strict}


def test_prefill_killed_before_the_read_recomputes_within_bound(llm, orphaned, decode) -> None:
    req, first = orphaned["requests"]["orphan"], orphaned["firsts"]["orphan"]
    [expected] = llm.generate([list(req.prompt_token_ids)], GREEDY)
    t0 = time.monotonic()
    rest = ray.get(decode.run.remote(req, first), timeout=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    assert tokens(first, rest) == expected.token_ids
    d = ray.get(decode.stats.remote())
    assert d.num_recomputed >= 1 and d.kv_pages_pinned == 0 and d.num_handoffs_pending == 0


def test_failure_policy_fail_ends_the_request_with_an_error(orphaned) -> None:
    strict = orphaned["strict"]
    req, first = orphaned["requests"]["strict"], orphaned["firsts"]["strict"]
    rest = ray.get(strict.run.remote(req, first), timeout=DEADLINE_S)
    assert rest[-1].finish_reason == "error" and "KV read" in (rest[-1].error or "")
    assert ray.get(strict.stats.remote()).kv_pages_pinned == 0


def test_stale_pages_are_detected_and_never_served(llm, prefill, decode) -> None:
    req = request(llm, "stale", SYSTEM + "Question: what is the capital of Italy?")
    [expected] = llm.generate([list(req.prompt_token_ids)], GREEDY)
    before = ray.get(decode.stats.remote()).num_recomputed
    first = ray.get(prefill.prefill.remote(req))
    ray.get(prefill.stale.remote(first.kv.lease_id))
    rest = ray.get(decode.run.remote(req, first), timeout=DEADLINE_S)
    assert tokens(first, rest) == expected.token_ids  # recomputed, not read from garbage
    assert ray.get(decode.stats.remote()).num_recomputed == before + 1


def test_a_prompt_whose_pages_decode_caches_already_is_not_read(llm, prefill, decode) -> None:
    ids = [1000 + 37 * j for j in range(32)]  # two whole pages, of no other test's prompt
    expected = llm.generate([ids], GREEDY)[0].token_ids
    moved = []
    for i in range(2):
        req = GenerateRequest(request_id=f"cached{i}", prompt_token_ids=ids, params=GREEDY)
        before = ray.get(decode.stats.remote())
        first = ray.get(prefill.prefill.remote(req))
        assert tokens(first, ray.get(decode.run.remote(req, first))) == expected
        after = ray.get(decode.stats.remote())
        moved.append(after.kv_pages_read - before.kv_pages_read)
    assert moved == [2, 0]
    assert after.kv_pages_reused - before.kv_pages_reused == 2
    assert after.num_recomputed == before.num_recomputed
    wait_until(
        lambda: ray.get(prefill.stats.remote()).kv_pages_pinned == 0,
        DEADLINE_S,
        what="prefill unpin",
    )
