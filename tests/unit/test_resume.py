"""A stream resumed on another decode engine (`DecodeEngine.add_remote` without a KV handle), or
on a prefill engine while no decode replica lives (`PrefillEngine.run_whole`), goes on exactly
where the first one stopped, and the fault hook strikes where it is told."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from workers.config import EngineConfig, FaultConfig, KVTransferConfig
from workers.disagg.decode import DecodeEngine
from workers.disagg.faults import Faults
from workers.disagg.prefill import PrefillEngine
from workers.engine.engine import RequestRejectedError
from workers.protocol import GenerateRequest, RequestOutput, SamplingParams

PROMPT = "The three primary colours are red, blue and"


@pytest.fixture(scope="module")
def engine() -> Iterator[DecodeEngine]:
    eng = DecodeEngine(EngineConfig(num_kv_pages=64, page_size=16), KVTransferConfig())
    yield eng
    eng.agent.close()  # its NIXL agent: none may outlive the test process's Ray


def drain(engine: DecodeEngine) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    while not (out and out[-1].finished):
        out += engine.poll() + engine.step()
    return out


def undisturbed(engine: DecodeEngine, rid: str, params: SamplingParams) -> list[RequestOutput]:
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, params=params))
    return drain(engine)


def resumed(engine: DecodeEngine, rid: str, params: SamplingParams,
            sent: list[RequestOutput]) -> list[RequestOutput]:  # fmt: skip
    """What a second engine streams after `sent` (the chunks the client had)."""
    first = RequestOutput(
        request_id=rid,
        token_ids=[t for c in sent for t in c.token_ids],
        text="".join(c.text for c in sent),
        logprobs=[lp for c in sent for lp in c.logprobs or []],
    )
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_remote(GenerateRequest(request_id=rid, prompt_token_ids=ids, params=params), first)
    return drain(engine)


def joined(chunks: list[RequestOutput]) -> tuple[list[int], str, list[int]]:
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        [lp.token_id for c in chunks for lp in c.logprobs or []],
    )


def test_a_resumed_stream_continues_the_undisturbed_one(engine: DecodeEngine) -> None:
    k = 5
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    whole = undisturbed(engine, f"whole{k}", params)
    assert len(whole) == 12  # a chunk per token
    rest = resumed(engine, f"rest{k}", params, whole[:k])
    assert joined(whole[:k] + rest) == joined(whole)
    assert rest[-1].finish_reason == "length"
    assert engine.stats().kv_pages_pinned == 0


def test_a_prefill_engine_runs_whole_and_resumed_streams_as_the_decode_engine(
    engine: DecodeEngine,
) -> None:
    """With no decode replica the prefill replica decodes: from the start, the same tokens, text
    and logprobs as a decode engine; from a failed stream's tokens, it goes on the same way.
    Nothing stays pinned for a hand-off."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    whole = undisturbed(engine, "whole-p", params)
    prefill = PrefillEngine(EngineConfig(num_kv_pages=64, page_size=16), KVTransferConfig())
    try:
        ids = prefill.tokenizer.encode(PROMPT)
        prefill.run_whole(GenerateRequest(request_id="p", prompt_token_ids=ids, params=params))
        assert joined(drain(prefill)) == joined(whole)  # type: ignore[arg-type]
        k = 5
        first = RequestOutput(
            request_id="q", token_ids=[t for c in whole[:k] for t in c.token_ids],
            text="".join(c.text for c in whole[:k]),
            logprobs=[lp for c in whole[:k] for lp in c.logprobs or []],
        )  # fmt: skip
        req = GenerateRequest(request_id="q", prompt_token_ids=ids, params=params)
        prefill.run_whole(req, first)
        rest = drain(prefill)  # type: ignore[arg-type]
        assert joined(whole[:k] + rest) == joined(whole)
        stats = prefill.stats()
        assert stats.kv_pages_pinned == 0 and stats.num_handoffs_pending == 0
        assert not prefill.whole and not prefill.seqs
    finally:
        prefill.agent.close()


def test_a_stop_string_across_the_seam_is_still_found(engine: DecodeEngine) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens, text, _ = joined(undisturbed(engine, "plain", plain))
    k = 6
    seam = len(engine.tokenizer.decode(tokens[:k]))  # where token k's text starts
    stop = text[seam - 2 : seam + 3]
    params = plain.model_copy(update={"stop": (stop,)})
    whole = undisturbed(engine, "stopped", params)
    assert len(whole) > k and whole[-1].stop_reason == stop
    rest = resumed(engine, "stopped-rest", params, whole[:k])
    assert joined(whole[:k] + rest) == joined(whole)
    assert rest[-1].stop_reason == stop


def test_a_resume_without_tokens_is_rejected(engine: DecodeEngine) -> None:
    req = GenerateRequest(request_id="empty", prompt_token_ids=(1, 2))
    with pytest.raises(RequestRejectedError):
        engine.add_remote(req, RequestOutput(request_id="empty"))
    assert "empty" not in engine.seqs


def test_faults_strike_once_at_their_point(engine: DecodeEngine, monkeypatch) -> None:  # noqa: ANN001
    marked = engine.tokenizer.encode("please fail here")
    faults = Faults(
        [
            FaultConfig(point="kv_read", action="fail", prompt_contains="fail", after=2),
            FaultConfig(point="step", action="delay", delay_s=0.5, role="prefill"),
            FaultConfig(point="decode_token", after=3),
        ],
        "decode",
        engine.tokenizer,
    )
    assert len(faults.faults) == 2  # the prefill pool's step fault is not this one's
    assert faults.strike("kv_read", engine.tokenizer.encode("all fine")) is None
    assert faults.strike("kv_read", marked) is None  # the first match: after=2
    fault = faults.strike("kv_read", marked)
    assert fault is not None and fault.action == "fail"
    assert faults.strike("kv_read", marked) is None  # times=1: spent
    exits: list[int] = []
    monkeypatch.setattr("os._exit", exits.append)
    assert faults.strike("decode_token", marked, num_tokens=2) is None and exits == []
    faults.strike("decode_token", marked, num_tokens=3)
    assert exits == [1]
    assert Faults.build((), "decode", engine.tokenizer) is None


def test_a_fault_must_fit_its_point() -> None:
    with pytest.raises(ValidationError):
        FaultConfig(point="prefill", action="fail")
    with pytest.raises(ValidationError):
        FaultConfig(point="step", prompt_contains="x")
    assert EngineConfig().faults == ()
