"""The KV hand-off between two VRAM pools: a PrefillEngine and a DecodeEngine in one process.

Both engines run on the GPU with the same bf16 random weights (`load_format="dummy"`, seed 0),
and so does a colocated `LLM` that gives the reference tokens. The two NIXL agents meet without
Ray: each loads the other's `metadata()`. NIXL's progress thread is off, so a READ advances only
while both agents are called: one loop drives both engines (`poll()`, `step()`), as their two
loop threads would. Requests go one at a time, so every engine runs the same batch shapes (the
same kernels) and the hand-off should change no bit of the tokens. The random model's logits are
nearly flat (top-2 gaps of a few 1e-3 are common), so the check is on log-probabilities first,
and the KV pages are compared byte for byte right after the read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from workers import LLM, SamplingParams  # noqa: E402
from workers.config import (
    EngineConfig,  # noqa: E402
    KVTransferConfig,  # noqa: E402
)
from workers.disagg.decode import DecodeEngine  # noqa: E402
from workers.disagg.prefill import PrefillEngine  # noqa: E402
from workers.protocol import GenerateRequest, RequestOutput, TokenLogprob  # noqa: E402

pytestmark = pytest.mark.gpu

ENGINE = dict(
    device="cuda",
    dtype="bfloat16",
    load_format="dummy",
    page_size=16,
    kv_cache_memory_gb=0.25,
    cuda_graph_batch_sizes=(1, 2, 4),
)
NEW_TOKENS = 24
NEAR_TIE = 0.05  # a top-2 log-prob gap within bf16 noise
DEADLINE_S = 30.0
# One partial page; two full pages and a partial one; exactly four full pages.
PROMPTS = [[(11 * i + 7 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((5, 40, 64))]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def engines(smollm2_random: Path) -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    cfg = EngineConfig(model=str(smollm2_random), **ENGINE)
    transfer = KVTransferConfig(lease_s=60.0)
    prefill = PrefillEngine(cfg, transfer, "p")
    decode = DecodeEngine(cfg, transfer, "d")
    assert prefill.agent.region.mem_type == decode.agent.region.mem_type == "VRAM"
    decode.agent.add_peer(prefill.agent.metadata())  # the reader loads the owner's record
    yield prefill, decode
    decode.agent.close()
    prefill.agent.close()


def drive(
    prefill: PrefillEngine, decode: DecodeEngine, done: Callable[[], bool], what: str, step: bool
) -> list[RequestOutput]:
    """Poll both engines (and step the decode one if `step`) until `done()`."""
    outputs: list[RequestOutput] = []
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < DEADLINE_S, f"timed out waiting for {what}"
        prefill.poll()
        outputs += decode.poll()
        if step:
            outputs += decode.step()
    return outputs


def prefill_first(prefill: PrefillEngine, req: GenerateRequest) -> RequestOutput:
    prefill.add_request(req)
    for _ in range(10):
        for out in prefill.step():
            assert out.request_id == req.request_id and out.kv is not None
            return out
    raise AssertionError("the prefill engine gave no first token")


def assert_pages_equal(
    prefill: PrefillEngine, decode: DecodeEngine, first: RequestOutput, local: list[int]
) -> None:
    """Every prompt token's K and V, in every layer, arrived bit for bit."""
    assert first.kv is not None
    n, ps = first.kv.num_tokens, first.kv.layout[0].page_size
    src, dst = prefill.runner.pool.pages, decode.runner.pool.pages
    for i, (remote, mine) in enumerate(zip(first.kv.page_ids, local)):
        count = min(ps, n - i * ps)  # [layers, 2, page_size, heads, dim]: the filled slots
        assert torch.equal(dst[mine][:, :, :count], src[remote][:, :, :count]), f"page {i}"


def hand_off(
    prefill: PrefillEngine, decode: DecodeEngine, req: GenerateRequest
) -> list[TokenLogprob]:
    """Prefill `req`, read its KV into the decode engine, decode it there; all its tokens."""
    first = prefill_first(prefill, req)
    assert prefill.stats().kv_pages_pinned > 0
    decode.add_remote(req, first)
    drive(prefill, decode, lambda: not decode.pending, "the KV read", step=False)
    seq = decode.seqs[req.request_id]
    assert_pages_equal(prefill, decode, first, seq.pages)
    chunks = drive(prefill, decode, lambda: seq.finished, "the decode", step=True)
    assert chunks[-1].finish_reason == "length"
    assert first.token_ids + [t for c in chunks for t in c.token_ids] == seq.output_token_ids
    drive(prefill, decode, lambda: prefill.stats().kv_pages_pinned == 0, "unpin", step=False)
    logprobs = (first.logprobs or []) + [lp for c in chunks for lp in c.logprobs or []]
    assert [lp.token_id for lp in logprobs] == seq.output_token_ids  # one per token, in order
    return logprobs


def test_handoff_over_vram_gives_the_colocated_tokens(
    engines: tuple[PrefillEngine, DecodeEngine], smollm2_random: Path
) -> None:
    prefill, decode = engines
    llm = LLM(str(smollm2_random), **ENGINE)
    for i, prompt in enumerate(PROMPTS):
        [ref] = llm.generate([prompt], greedy())
        req = GenerateRequest(request_id=f"h{i}", prompt_token_ids=prompt, params=greedy())
        ours = hand_off(prefill, decode, req)
        assert ref.logprobs is not None and len(ours) == len(ref.logprobs) == NEW_TOKENS
        for t, (mine, theirs) in enumerate(zip(ours, ref.logprobs)):
            assert abs(mine.logprob - theirs.logprob) < NEAR_TIE, (i, t, mine, theirs)
            if mine.token_id != theirs.token_id:  # only where the reference nearly tied
                assert mine.token_id in theirs.top, (i, t, mine, theirs)
                best, second = sorted(theirs.top.values(), reverse=True)
                assert best - second < NEAR_TIE, (i, t, mine, theirs)
                break  # after a tie the two continuations differ by right
    stats = decode.stats()
    assert stats.num_recomputed == 0 and stats.kv_pages_reused == 0
    assert stats.kv_pages_read == sum(-(-len(p) // 16) for p in PROMPTS)
    page_bytes = prefill.runner.kv_layout.page_bytes
    assert stats.nixl_bytes_transferred == stats.kv_pages_read * page_bytes > 0
    assert prefill.stats().num_handoffs_pending == 0 and decode.stats().kv_pages_pinned == 0
