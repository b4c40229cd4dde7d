"""Whether a sequence's newest token ends it, the logprob entry of a sampled row, and the chunk
of a sequence's output not yet sent."""

from __future__ import annotations

from workers.protocol import FinishReason, RequestOutput, TokenLogprob
from workers.sampling.sampler import SampleResult
from workers.sequence import SeqStatus, Sequence


def check_finish(seq: Sequence, token: int, max_model_len: int) -> None:
    """Mark `seq` finished if `token`, just appended, ends it (EOS or a stop token, a stop
    string, its grammar's end or error, max_tokens, the context's end)."""
    p = seq.params
    may_stop = seq.num_output_tokens >= p.min_tokens
    assert seq.detokenizer is not None
    if may_stop and token in seq.stop_token_ids:  # EOS has no stop_reason
        seq.finish_reason = "stop"
        seq.stop_reason = token if token in p.stop_token_ids else None
    elif (stop := seq.detokenizer.add_token(token, match_stop=may_stop)) is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop
    elif seq.constraint is not None and (done := _constraint_done(seq)) is not None:
        seq.finish_reason = done
    elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= max_model_len:
        seq.finish_reason = "length"
    if seq.finish_reason is not None:
        seq.status = SeqStatus.FINISHED


def _constraint_done(seq: Sequence) -> FinishReason | None:
    """ "stop" once `seq`'s grammar is complete (even under `min_tokens`: it allows nothing
    more), "error" if its matcher refused a token."""
    assert seq.constraint is not None
    seq.constraint.sync(seq.output_token_ids)
    if (error := seq.constraint.error) is not None:
        seq.error = error
        return "error"
    return "stop" if seq.constraint.finished else None


def token_logprob(result: SampleResult, row: int, top_n: int) -> TokenLogprob:
    """Row `row` of `result` (its token and logprob, and the first `top_n` of its best)."""
    assert result.logprobs is not None
    top = {}
    if top_n and result.top_ids is not None and result.top_logprobs is not None:
        top = dict(zip(result.top_ids[row][:top_n], result.top_logprobs[row][:top_n]))
    rank = None if result.ranks is None else result.ranks[row]
    return TokenLogprob(
        token_id=result.token_ids[row], logprob=result.logprobs[row], top=top, rank=rank
    )


def take_output(seq: Sequence) -> RequestOutput:
    """`seq`'s chunk: its output since the last one taken (all of it once it finished)."""
    start, seq.num_emitted_tokens = seq.num_emitted_tokens, seq.num_output_tokens
    assert seq.detokenizer is not None
    return RequestOutput(
        request_id=seq.request_id,
        token_ids=seq.output_token_ids[start:],
        text=seq.detokenizer.take_new_text(seq.finished),
        logprobs=seq.logprobs[start:] if seq.params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        prompt_logprobs=seq.prompt_logprobs
        if start == 0 and seq.params.prompt_logprobs is not None
        else None,
        error=seq.error,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
    )
